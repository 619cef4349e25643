"""torchGB's `GenomicBottleneck` training-loop API, as a thin shell over plan/init/apply.

For porting torchGB scripts; the loop stays as it was::

    gnets = GenomicBottleneck(model)    # plain, DDP-wrapped or torch.compile'd
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:
        optimizer.zero_grad()
        gnets.zero_grad()
        gnets.predict_weights()         # generated weights -> p-net parameters
        loss = criterion(model(x), y)
        loss.backward()
        gnets.backward()                # p-net grads -> g-net grads
        optimizer.step()                # free parameters only
        gnets.step()

What differs from torchGB, on purpose:
- One optimizer over the stacked g-nets (`gparams["stacks"]`), not one per tile.
- `backward()` sets the generated parameters' `.grad` to None, so the user's optimizer skips
  them: no optimizer state and no weight decay for weights the next `predict_weights()`
  overwrites. Free parameters (biases, norms, embeddings) are trained by the user's
  optimizer, as in torchGB. Clipping `model.parameters()` after `backward()` therefore clips
  free parameters only.
- G-nets receive the exact gradient of the loss (torchGB divides it by `N_tile * sigma^2`).
- `compression()` counts the unwrapped model, so it is right for DDP-wrapped models.
- With DDP, every rank holds the same g-nets and gets the same all-reduced p-net gradients,
  so the replicas stay identical without further communication; `save` writes on rank 0 only.
"""

import copy
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ._apply import apply
from ._check_model import unwrap
from ._checkpoint import CheckpointMismatchError, read, restore_buffers
from ._checkpoint_checks import optimizer_class
from ._init import init
from ._numbers import as_integer, integer, real
from ._options import check_tile
from ._plan import Free, Generated, Plan
from ._planner import plan
from ._replicated import save_replicated
from ._report import report
from ._tree import stack_leaves

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer, float], Any]  # torchGB's: f(optimizer, lr)
# With a scheduler, the checkpoint's opt_state is {_OPTIMIZER: ..., _SCHEDULER: ...}.
_OPTIMIZER, _SCHEDULER = "compat.optimizer", "compat.scheduler"


class GenomicBottleneck:
    """Generate `model`'s weights with g-nets, driven by torchGB's method calls.

    The constructor takes torchGB's arguments, current and older, by keyword after the
    second: `GenomicBottleneck(model, local_rank_dict, hidden_dim=..., scheduler=..., lr=...,
    gnet_batchsize=..., ignore_layers=..., compression=..., hypernet_type=...)`, and the older
    `GenomicBottleneck(model, num_batches, ...)` (an int second is read as `num_batches`, not
    as the `hidden_dim` some versions took there). The g-nets take the model's dtype, but
    float32 for a float16 or bfloat16 model (torchGB's are float32 throughout); the weights
    they generate are cast into the model's.

    Args:
        model: The p-net, plain or wrapped in DDP/DataParallel or torch.compile.
        local_rank_dict: torchGB's map from rank to device (a dict, which it needs on CPU);
            the g-nets live on the model's device, every rank holding them all, so it is
            not used. An int here is older torchGB's `num_batches`.
        hidden_dim: Hidden width of every g-net.
        lr: Learning rate of the default g-net optimizer.
        compression: Choose tiles for this ratio of generated weights per g-net parameter
            (torchGB's count; `gb.plan(compression_of="generated")`); exclusive with `tile`
            and `gnet_batchsize`.
        ignore_layers: Parameters whose dotted name contains any of these substrings stay
            free (torchGB's rule; substrings that match nothing are ignored, as in torchGB).
        tile: `(TH, TW)` or `"full"` (see `gb.plan`); default `gb.plan`'s.
        gnet_batchsize: torchGB's tile size in weights: square tiles of
            `ceil(sqrt(gnet_batchsize))` rows and columns, as torchGB tiles matrices (its
            convolutions divide by the kernel's size first; here the tile is the kernel
            matrix's, as for `tile`).
        scheduler: torchGB's `f(optimizer, lr) -> scheduler` for the g-net optimizer,
            stepped by `step()` after the optimizer; its state is saved and loaded with the
            optimizer's.
        hypernet_type: `"g-net"` (or `"gnet"`), torchGB's default; its other types
            (stochastic g-nets, low rank, XOX) are not implemented here and are refused.
        seed: Seed of `gb.init`.
        optimizer: `f(leaves) -> torch.optim.Optimizer` for the g-net stacks; default
            `AdamW(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)`, torchGB's.
        num_batches: Older torchGB's second argument, also accepted by name; unused (it
            sized a scheduler that those versions no longer built).

    Examples:
        >>> gnets = GenomicBottleneck(nn.Linear(256, 256), hidden_dim=32, tile=(64, 64))
        >>> round(gnets.compression(), 1)
        8.8
    """

    def __init__(
        self,
        model: nn.Module,
        local_rank_dict: Mapping[int, object] | int | None = None,
        *,
        hidden_dim: int = 32,
        lr: float = 1e-3,
        compression: float | None = None,
        ignore_layers: Sequence[str] = (),
        tile: tuple[int, int] | str | None = None,
        gnet_batchsize: int | None = None,
        scheduler: SchedulerFactory | None = None,
        hypernet_type: str = "g-net",
        seed: int = 0,
        optimizer: OptimizerFactory | None = None,
        num_batches: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GenomicBottleneck: model must be an nn.Module, got {type(model).__name__}."
            )
        older = as_integer(local_rank_dict) is not None  # older torchGB's num_batches
        if not (isinstance(local_rank_dict, Mapping) or older or local_rank_dict is None):
            raise TypeError(
                "GenomicBottleneck: local_rank_dict must be a dict {rank: device} (or older "
                f"torchGB's num_batches, an int) or None, got {local_rank_dict!r:.100}."
            )
        integer("GenomicBottleneck", "num_batches", num_batches, optional=True)
        if hypernet_type not in ("g-net", "gnet"):
            raise ValueError(
                f"GenomicBottleneck: hypernet_type={hypernet_type!r} is not implemented here; "
                "only torchGB's default, 'g-net' (gbfunc's genome options cover others: see "
                "gb.plan)."
            )
        if scheduler is not None and not callable(scheduler):
            raise TypeError(
                f"GenomicBottleneck: scheduler must be a callable f(optimizer, lr) or None, "
                f"got {scheduler!r}."
            )
        tile = _tile_of(gnet_batchsize, tile, compression)
        hidden_dim, lr, compression, seed = _check_options(
            hidden_dim, lr, compression, ignore_layers, tile, seed, optimizer
        )
        if isinstance(ignore_layers, str):
            ignore_layers = (ignore_layers,)
        self.model = model
        pnet = unwrap(model)
        self._params = dict(pnet.named_parameters())
        free = [f"*{s}*" for s in ignore_layers if any(s in name for name in self._params)]
        self.plan: Plan = plan(
            pnet,
            tile=tile,
            hidden=hidden_dim,
            compression=compression,
            # torchGB's count: weights per g-net parameter
            compression_of="model" if compression is None else "generated",
            free=free,
        )
        first = self._params[self.plan.generated[0].name]
        # Half-precision models get float32 g-nets (torchGB's are float32 throughout): in
        # bfloat16 most of Adam's small steps round away. Their weights are cast on copy.
        half = first.dtype in (torch.float16, torch.bfloat16)
        dtype = torch.float32 if half else first.dtype
        stacks = init(self.plan, seed, dtype=dtype, device=first.device)["stacks"]
        # Free parameters are the p-net's own, so `apply` passes them through untouched.
        self.gparams = {
            "stacks": stacks,
            "free": {p.name: self._params[p.name] for p in self.plan.free if p.trainable},
            "frozen": {p.name: self._params[p.name] for p in self.plan.free if not p.trainable},
        }
        self._make_optimizer: OptimizerFactory = optimizer or (
            lambda leaves: torch.optim.AdamW(leaves, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        )
        self.optimizer = self._make_optimizer(stack_leaves(stacks))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "GenomicBottleneck: optimizer(leaves) must return a torch.optim.Optimizer, "
                f"got {type(self.optimizer).__name__}."
            )
        self._make_scheduler, self._lr = scheduler, lr
        self.scheduler = None if scheduler is None else scheduler(self.optimizer, lr)
        if self.scheduler is not None and not all(
            callable(getattr(self.scheduler, m, None)) for m in ("step", "state_dict")
        ):
            raise TypeError(
                "GenomicBottleneck: scheduler(optimizer, lr) must return a learning-rate "
                f"scheduler (with step and state_dict), got {type(self.scheduler).__name__}."
            )
        self._weights: dict[str, Tensor] = {}
        self._with_grad = False
        self._warned: set[tuple[str, ...]] = set()  # parameters named by a warning already

    def predict_weights(self) -> None:
        """Generate every g-net weight and write it into the p-net's parameter, in place.

        With gradients enabled the generated tensors keep their graph for `backward()`;
        under `torch.no_grad()` (e.g. rollouts) only the values are written.
        """
        self._check_params("GenomicBottleneck.predict_weights")
        params = apply(self.gparams, self.plan)
        self._weights = {p.name: params[p.name] for p in self.plan.generated}
        self._with_grad = torch.is_grad_enabled()
        with torch.no_grad():
            for name, weight in self._weights.items():
                self._params[name].copy_(weight)

    def backward(self) -> None:
        """Pull the p-net's gradients of generated weights into the g-nets, then drop them.

        After it, generated parameters have `.grad = None`, so the user's optimizer skips
        them. Call once per `predict_weights()`, after `loss.backward()`.
        """
        if not self._weights:
            raise RuntimeError(
                "GenomicBottleneck.backward: call predict_weights() before backward()."
            )
        if not self._with_grad:
            raise RuntimeError(
                "GenomicBottleneck.backward: the last predict_weights() ran without gradients "
                "(torch.no_grad()); call it with gradients enabled before the forward pass."
            )
        pairs = [
            (w, self._params[n].grad)
            for n, w in self._weights.items()
            if self._params[n].grad is not None and w.requires_grad  # a frozen stack's: not
        ]
        self._warn_without_gradient({n for n, w in self._weights.items() if w.requires_grad})
        if pairs:
            torch.autograd.backward([w for w, _ in pairs], [g for _, g in pairs])
        for name in self._weights:
            self._params[name].grad = None
        self._weights = {}  # the graph is consumed

    def _warn_without_gradient(self, trained: set[str]) -> None:
        """Warn once per set of generated parameters that the last backward left without a
        gradient (unused in the forward, or frozen after construction): in plain PyTorch the
        optimizer skips them, here their g-nets still move (weight decay, momentum) with
        the stack they share."""
        missing = sorted(n for n in trained if self._params[n].grad is None)
        if missing and tuple(missing) not in self._warned:
            self._warned.add(tuple(missing))
            warnings.warn(
                f"GenomicBottleneck.backward: generated parameters {missing} got no gradient "
                "(unused in the forward, or requires_grad set False after construction); "
                "their g-nets still change at step() (weight decay, momentum). To keep them "
                "fixed, build the GenomicBottleneck with ignore_layers= naming them.",
                UserWarning,
                stacklevel=3,
            )

    def _check_params(self, where: str) -> None:
        """Raise unless the p-net still holds the parameter tensors this object was built on:
        `load_state_dict(..., assign=True)` replaces them, and weights written into the old
        ones would neither reach the model nor train the g-nets."""
        current = dict(unwrap(self.model).named_parameters())
        for name, param in self._params.items():
            if current.get(name) is not param:
                raise RuntimeError(
                    f"{where}: the model's parameter {name!r} is no longer the tensor this "
                    "GenomicBottleneck was built on (replaced, e.g. by "
                    "load_state_dict(..., assign=True)); load weights without assign=True, "
                    "or build the GenomicBottleneck after replacing them."
                )

    def zero_grad(self) -> None:
        """Clear the g-nets' gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Update the g-nets, then step the scheduler (where one was given), as torchGB."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def train(self, mode: bool = True) -> "GenomicBottleneck":
        """Set the p-net's training mode (torchGB's `train()`, with `mode` as in `nn.Module`)."""
        self.model.train(mode)
        return self

    def eval(self) -> "GenomicBottleneck":
        """Put the p-net in evaluation mode."""
        return self.train(False)

    def compression(self) -> float:
        """Dense parameters of the (unwrapped) p-net per stored parameter: the whole model's
        ratio, as torchGB's `compression()` counts it. The constructor's `compression=`
        counts generated weights per g-net parameter (torchGB's per-tile count), which free
        embeddings, biases and norms do not lower; `repr()` shows both."""
        return report(self.plan).compression

    def save(self, fname: str | os.PathLike) -> None:
        """Write g-nets, free parameters and g-net optimizer state (`gb.save` format), and the
        scheduler's state where there is a scheduler (then `opt_state` is `{"compat.optimizer":
        ..., "compat.scheduler": ...}`, both stored as they are: int keys, tensors and all).
        `meta["compat.optimizer"]` names the optimizer's class, which `load` checks.

        Under `torch.distributed` rank 0 writes and every rank returns once the file is
        complete (`gb.dist.save_replicated`); call it on every rank.
        """
        self._check_params("GenomicBottleneck.save")
        state: dict[str, object] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state = {_OPTIMIZER: state, _SCHEDULER: self.scheduler.state_dict()}
        meta = {
            "writer": "gbfunc.compat.GenomicBottleneck",
            _OPTIMIZER: optimizer_class(self.optimizer),
        }
        save_replicated(fname, self.gparams, self.plan, opt_state=state, meta=meta)

    def load(self, fname: str | os.PathLike) -> None:
        """Restore a file written by `save`: g-nets, optimizer and scheduler state, free
        parameters and the model's buffers, into this object's own tensors, optimizer and
        scheduler (so that whatever holds them, a scheduler built on `optimizer` say, stays
        in step).

        Everything is read and checked first (file, hash, model, plan, optimizer and scheduler
        state, on throwaway copies); only then is anything replaced, and the p-net's
        generated weights are re-predicted. The checkpoint's plan is taken, with the scales
        its g-nets were trained under (this object may have been built on trained weights,
        whose stds set other scales). A file saved without a scheduler keeps this object's
        scheduler and the rates it set.
        """
        self._check_params("GenomicBottleneck.load")  # before anything is replaced
        first = next(iter(self.gparams["stacks"].values()))["w_in"]
        pnet = unwrap(self.model)
        where = f"GenomicBottleneck.load: {os.fspath(fname)}"
        ckpt, buffers = read(fname, pnet, "GenomicBottleneck.load", device=first.device)
        if _unscaled(ckpt.plan) != _unscaled(self.plan):
            raise CheckpointMismatchError(
                f"{where}: {_difference(ckpt.plan, self.plan)}; "
                "build the GenomicBottleneck with the options the checkpoint was saved with."
            )
        stacks = ckpt.gparams["stacks"]  # copied below, cast into this object's leaves
        optimizer_state, scheduler_state = _split_state(ckpt.opt_state)
        saved_with = (ckpt.meta or {}).get(_OPTIMIZER)  # None: written before 2026-11-30
        ours = optimizer_class(self.optimizer)
        if saved_with not in (None, ours) and optimizer_state is not None:
            raise CheckpointMismatchError(
                f"{where}: its optimizer state is {saved_with}'s and this "
                f"GenomicBottleneck's optimizer is {ours}; build it with the optimizer= "
                "it was saved with."
            )
        self._try_states(stacks, optimizer_state, scheduler_state, where)
        # first: it writes all or none, so that a failure changes nothing
        restore_buffers(pnet, buffers, where)
        with torch.no_grad():
            for group in ("free", "frozen"):
                for name, value in ckpt.gparams[group].items():
                    self._params[name].copy_(value)
            for key, leaves in stacks.items():
                for name, value in leaves.items():
                    self.gparams["stacks"][key][name].copy_(value)
        # Saved without a scheduler, loaded with one: the new scheduler's rates stand.
        rates = [
            {k: g[k] for k in ("lr", "initial_lr") if k in g} for g in self.optimizer.param_groups
        ]
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        else:
            self.optimizer.state.clear()
        if self.scheduler is not None and scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        elif self.scheduler is not None:
            for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                group.update(rate)
        # The scales its g-nets were trained under (a plan measures the model's weights when
        # it is made, so one built after trained weights were loaded differs in them alone).
        self.plan = ckpt.plan
        with torch.no_grad():
            self.predict_weights()
        self._weights = {}

    def _try_states(
        self,
        stacks: dict[str, dict[str, Tensor]],
        optimizer_state: dict | None,
        scheduler_state: dict | None,
        where: str,
    ) -> None:
        """Raise `CheckpointMismatchError` unless the states load into an optimizer (and a
        scheduler) made as this object's were, over copies of the checkpoint's leaves."""
        if scheduler_state is not None and self.scheduler is None:
            raise CheckpointMismatchError(
                f"{where}: it holds a scheduler's state, and this GenomicBottleneck has no "
                "scheduler; build it with the scheduler= it was saved with."
            )
        if optimizer_state is None:
            return
        copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in stack_leaves(stacks)]
        trial = self._make_optimizer(copies)
        try:  # on copies of the states too: some loads take keys out (CyclicLR's)
            trial.load_state_dict(copy.deepcopy(optimizer_state))
            if scheduler_state is not None:  # (then there is a scheduler: checked above)
                scheduler = self._make_scheduler(trial, self._lr)
                scheduler.load_state_dict(copy.deepcopy(scheduler_state))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointMismatchError(
                f"{where}: the optimizer or scheduler state does not fit this one "
                f"({type(e).__name__}: {e})."
            ) from None

    def __repr__(self) -> str:
        rep = report(self.plan)
        tiles = sum(s.num_tiles for s in self.plan.stacks)
        name = type(unwrap(self.model)).__name__
        return (
            f"GenomicBottleneck({name}: {len(self.plan.generated)} generated tensors, {tiles} "
            f"tiles in {len(self.plan.stacks)} stacks, {rep.gnet_params:,} g-net parameters, "
            f"compression {rep.compression:.2f}x of the whole model, "
            f"{rep.generated_compression:.2f}x of the generated weights)\n{rep}"
        )


def _check_options(
    hidden_dim: object,
    lr: object,
    compression: object,
    ignore_layers: object,
    tile: object,
    seed: object,
    optimizer: object,
) -> tuple[int, float, float | None, int]:
    """`hidden_dim`, `lr`, `compression` and `seed` as Python numbers; raises unless
    `GenomicBottleneck`'s options are valid: `TypeError` for a wrong type, `ValueError` for
    a wrong value, each naming the option."""
    where = "GenomicBottleneck"
    checked = (
        integer(where, "hidden_dim", hidden_dim, minimum=1),
        real(where, "lr", lr, above=0),
        real(where, "compression", compression, minimum=1, optional=True),
        integer(where, "seed", seed),
    )
    layers = (ignore_layers,) if isinstance(ignore_layers, str) else ignore_layers
    if not isinstance(layers, Sequence | Set) or not all(isinstance(s, str) for s in layers):
        raise TypeError(
            f"{where}: ignore_layers must be a name substring or a list of them (str), "
            f"got {ignore_layers!r}."
        )
    if tile is not None:
        check_tile("tile", tile, call=where)
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"{where}: optimizer must be a callable f(leaves) -> torch.optim.Optimizer or None, "
            f"got {optimizer!r}."
        )
    return checked


def _split_state(opt_state: object) -> tuple[dict | None, dict | None]:
    """A checkpoint's `(optimizer state, scheduler state)`: `save` wraps the two together
    where there is a scheduler, else stores the optimizer's alone."""
    if isinstance(opt_state, dict) and set(opt_state) == {_OPTIMIZER, _SCHEDULER}:
        return opt_state[_OPTIMIZER], opt_state[_SCHEDULER]
    return (opt_state if isinstance(opt_state, dict) else None), None


def _tile_of(
    gnet_batchsize: object, tile: tuple[int, int] | str | None, compression: object
) -> tuple[int, int] | str | None:
    """`tile`, or torchGB's square tile of about `gnet_batchsize` weights where that is given
    (then neither `tile` nor `compression` may be)."""
    if gnet_batchsize is None:
        return tile
    size = integer("GenomicBottleneck", "gnet_batchsize", gnet_batchsize, minimum=1)
    if tile is not None or compression is not None:
        raise ValueError(
            "GenomicBottleneck: pass one of gnet_batchsize, tile and compression (each sets "
            "the tiles)."
        )
    side = math.isqrt(size - 1) + 1  # ceil(sqrt(size)), as torchGB
    return (side, side)


def _describe(p: Generated | Free, owner: Plan) -> str:
    if isinstance(p, Free):
        return f"free ({p.reason})"
    stack = owner.stacks[p.stack_index]
    return f"generated on {stack.tile[0]}x{stack.tile[1]} tiles by {stack.genome}"


def _unscaled(plan: Plan) -> Plan:
    """`plan` with every generated weight's `scale` and `start` set to 1: what `load` needs to
    match (the scales come from the model's weights when the plan is made)."""
    params = tuple(
        replace(p, scale=1.0, start=1.0) if isinstance(p, Generated) else p for p in plan.params
    )
    return replace(plan, params=params)


def _difference(theirs: Plan, ours: Plan) -> str:
    for a, b in zip(theirs.params, ours.params, strict=True):
        if (da := _describe(a, theirs)) != (db := _describe(b, ours)):
            return f"parameter {a.name!r} is {da} in the checkpoint but {db} here"
    return "the checkpoint's g-net stacks are laid out differently"
