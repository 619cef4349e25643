"""What libraries that drive a model read from it, answered by `gb.Bottleneck` for its p-net.

transformers' `Trainer`, accelerate and `generate` ask the model they are given for its
forward's signature (to choose dataset columns), its `config` (to turn the KV cache off in
training and leave it out of the outputs), its embeddings (NEFTune's hook) and `generate`.
A `gb.Bottleneck` answers with its p-net's, and generates with the g-nets' weights; and it
recomputes its p-net's BatchNorm statistics, which `torch.optim.swa_utils.update_bn` cannot
reach (`update_bn`).
"""

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm


def with_pnet_signature(function: Callable[..., Any]) -> "_WithPnetSignature":
    """Decorate `forward` so that, on an instance, its signature is the p-net's forward's."""
    return _WithPnetSignature(function)


class _WithPnetSignature:
    """A method whose bound form reports the p-net's signature (see `_BoundForward`)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__

    def __get__(self, module: "PnetFace | None", owner: type | None = None) -> Any:
        return self.function if module is None else _BoundForward(self.function, module)


class _BoundForward:
    """`Bottleneck.forward` bound to a module, with `__signature__` read from its p-net.

    A bound method's signature is its function's, `(*args, **kwargs)` here, and cannot be set
    per instance; this callable can. It holds no state of its own, so the module still
    deep-copies, pickles and compiles (`fullgraph=True`) as before. Like a bound method it
    exposes its function's `__code__`, which `torch.export` reads, and `__func__`, which
    accelerate wraps (in autocast) and binds again as `forward`: that function carries the
    p-net's signature too, or a later `Trainer` would drop every dataset column.
    """

    __slots__ = ("__self__", "_function")

    def __init__(self, function: Callable[..., Any], module: "PnetFace") -> None:
        self._function = function
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(self.__self__, *args, **kwargs)

    @property
    def __name__(self) -> str:
        return self._function.__name__

    @property
    def __code__(self) -> Any:
        return self._function.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.pnet.forward)

    @property
    def __func__(self) -> Callable[..., Any]:
        function = self._function

        @functools.wraps(function)
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            return function(module, *args, **kwargs)

        pnet = self.__signature__
        first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        forward.__signature__ = pnet.replace(parameters=[first, *pnet.parameters.values()])
        return forward


class PnetFace:
    """`gb.Bottleneck`'s answers, for its p-net, to what trainers read from a model.

    Each reads the p-net's attribute, so where the p-net has none (a plain `nn.Module`), the
    module has none either (`hasattr` is False, as trainers test it).
    """

    pnet: nn.Module
    _keys_to_ignore_on_save = None  # transformers' Trainer reads it after loading a state

    def _pnet_tensors(self) -> dict[str, Tensor]:
        raise NotImplementedError

    @property
    def config(self) -> Any:
        """The p-net's config (transformers' `Trainer` sets `use_cache=False` on it)."""
        return self.pnet.config

    @property
    def generation_config(self) -> Any:
        """The p-net's generation config."""
        return self.pnet.generation_config

    @property
    def main_input_name(self) -> str:
        """The p-net's main input's name."""
        return self.pnet.main_input_name

    def get_input_embeddings(self) -> nn.Module:
        """The p-net's input embedding module (hooks on it run in `forward`)."""
        return self.pnet.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The p-net's output embedding module."""
        return self.pnet.get_output_embeddings()

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether the p-net takes loss keywords (read by transformers' `Trainer`)."""
        found = getattr(self.pnet, "accepts_loss_kwargs", None)
        if isinstance(found, bool):
            return found
        params = inspect.signature(self.pnet.forward).parameters.values()
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The p-net's `generate` (transformers) with the weights the g-nets generate, made
        once for the whole generation. `b.pnet.generate` would use the p-net's own dense
        weights, which training never changes."""
        generate = getattr(self.pnet, "generate", None)
        if generate is None:
            raise AttributeError(
                f"gb.Bottleneck: the p-net ({type(self.pnet).__name__}) has no generate."
            )
        tensors = self._pnet_tensors()
        return functional_call(_Generate(self.pnet), _prefixed(tensors), args, kwargs)

    @torch.no_grad()
    def update_bn(self, loader: Iterable[Any], device: torch.device | str | None = None) -> None:
        """Recompute the p-net's BatchNorm running statistics over `loader`, under the
        generated weights: `torch.optim.swa_utils.update_bn` for this module. Given the
        module, torch's finds no BatchNorm (module walks do not reach the p-net) and returns
        without a word; given `b.pnet`, it would run the p-net's dense weights, which training
        never changes. For an SWA or EMA average: `swa_model.module.update_bn(loader)`. Each
        batch is taken as torch's takes it: a tensor, or the first item of a list or tuple,
        moved to `device` where given."""
        norms = [m for m in self.pnet.modules() if isinstance(m, _BatchNorm)]
        if not norms:
            return
        momenta = [m.momentum for m in norms]
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over the batches
        training = self.training
        self.train()
        try:
            for batch in loader:
                batch = batch[0] if isinstance(batch, list | tuple) else batch
                self(batch if device is None else batch.to(device))
        finally:
            for norm, momentum in zip(norms, momenta, strict=True):
                norm.momentum = momentum
            self.train(training)


class _Generate(nn.Module):
    """A module whose forward is `model.generate`: `functional_call` runs forwards only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.generate(*args, **kwargs)


def _prefixed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {f"model.{name}": t for name, t in tensors.items()}
