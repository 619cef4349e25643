"""`gb.Bottleneck`: a model's g-nets as an `nn.Module`, for trainers that expect one.

Its parameters are the compressed ones only, so optimizers, DDP, FSDP2, `state_dict` and the
Trainers of transformers, Lightning and Accelerate see what is trained and stored; `forward`
generates the p-net's weights with `gb.apply` and runs the p-net through `functional_call`.

Names. `nn.ParameterDict` and buffer names cannot contain `"."`, and p-net parameter names
do, so every name is escaped: `"%"` becomes `"%25"`, then `"."` becomes `"%2E"` (percent
encoding, reversed by `unescape`). `gparams["free"]["h.0.ln.bias"]` is the parameter
`free["h%2E0%2Eln%2Ebias"]` and the `state_dict` key `"free.h%2E0%2Eln%2Ebias"`.
"""

import difflib
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._apply import apply
from ._buffers import is_persistent
from ._calibrate import calibrate, check_inputs
from ._check_gparams import TASKS, check_gparams, expected_shapes
from ._check_model import check_matches, check_module
from ._checkpoint import load
from ._export import export
from ._init import init
from ._numbers import as_integer
from ._plan import Plan
from ._planner import plan as make_plan
from ._report import Report, report
from ._tree import GParams
from .optim import param_groups

# Names a top-level parameter or buffer may have that a `ParameterDict` (or `_Buffers`)
# already uses for an attribute or method: registering them raises "attribute exists".
_TAKEN = frozenset(dir(nn.ParameterDict)) | {"get"}


def escape(name: str) -> str:
    """`name` as an `nn.Module` attribute: `%` -> `%25`, then `.` -> `%2E`, and the first
    character of a name the holding dict already uses (`keys`, `values`, ...) as `%XX`
    (reversible: every `%` in the result is an escape)."""
    key = name.replace("%", "%25").replace(".", "%2E")
    return f"%{ord(key[0]):02X}{key[1:]}" if key in _TAKEN else key


def unescape(key: str) -> str:
    """Inverse of `escape`."""
    return re.sub("%([0-9A-F]{2})", lambda m: chr(int(m[1], 16)), key)


class _Buffers(nn.Module):
    """Tensors held as buffers under escaped names (frozen parameters, the p-net's buffers)."""

    def __init__(self, tensors: dict[str, Tensor], persistent: dict[str, bool]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(escape(name), t, persistent=persistent[name])

    def get(self, name: str) -> Tensor:
        return self._buffers[escape(name)]


class _WithPnetSignature:
    """A method whose bound form reports the p-net's signature (see `_BoundForward`)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__

    def __get__(self, module: "Bottleneck | None", owner: type | None = None) -> Any:
        return self.function if module is None else _BoundForward(self.function, module)


class _BoundForward:
    """`Bottleneck.forward` bound to a module, with `__signature__` read from its p-net.

    A bound method's signature is its function's, `(*args, **kwargs)` here, and cannot be set
    per instance; this callable can. It holds no state of its own, so the module still
    deep-copies, pickles and compiles (`fullgraph=True`) as before. Like a bound method it
    exposes its function's `__code__`, which `torch.export` reads.
    """

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable[..., Any], module: "Bottleneck") -> None:
        self.__func__ = function
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    @property
    def __code__(self) -> Any:
        return self.__func__.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.pnet.forward)


# Activation checkpointing inside the p-net recomputes its layers in the backward pass, after
# `functional_call` has put the p-net's own (unused, stale) weights back: wrong gradients.
_CHECKPOINTING = (
    "gb.Bottleneck: gradient checkpointing inside the p-net would recompute its layers in the "
    "backward pass with the p-net's own dense weights, not the generated ones (wrong "
    "gradients); checkpoint the whole call instead: torch.utils.checkpoint.checkpoint(b, x, "
    "use_reentrant=False), or turn it off (model.activation_checkpointing_disable())."
)


def _checkpointing(pnet: nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on in `pnet` (its flag's name since
    transformers 5; the older one, which 5 deprecates, only where the new one is missing)."""
    new = getattr(pnet, "is_activation_checkpointing", None)
    return bool(getattr(pnet, "is_gradient_checkpointing", False) if new is None else new)


class Bottleneck(nn.Module):
    """`model` whose weights are generated by g-nets; only the g-nets are its parameters.

    Parameters (what optimizers, DDP, FSDP2 and trainers see):
    `stacks[key][leaf]` for every g-net stack leaf and `free[escape(name)]` for every free
    parameter, mirroring `gparams` (see the module docstring for `escape`). Frozen parameters
    are buffers (`frozen`), so they are stored and moved by `.to()` but never trained or
    all-reduced. The p-net's buffers (e.g. BatchNorm running statistics) are registered here
    too (`pnet_buffers`, persistent as in the p-net) as the *same* tensors the p-net holds:
    BatchNorm updates them in train mode, `state_dict` stores them and DDP broadcasts them.

    The p-net itself is kept in a plain attribute (`self.pnet`), not as a submodule, so its
    dense parameters are neither trained nor stored nor moved: `.to()` moves the compressed
    parameters and the buffers only (the p-net's buffers stay shared with it); `train()` and
    `eval()` reach the p-net. Its dense weights are never read: `forward` passes generated
    ones, so the p-net may even sit on the `meta` device (if it has no buffers), and then the
    dense weights are never allocated. `state_dict()` is the compressed model; `export()`
    gives the dense one. `gb.save(path, b.gparams, b.plan)` stores the g-nets and the
    p-net's buffers (`b.plan` names `b.pnet` as its model), and `from_checkpoint` restores
    both.

    A conditioned plan (`condition=`, `tasks=`) generates the weights of the condition
    vector in `b.condition`, or of the task embedding `b.task` names (`b.tasks`, a
    parameter); set one before calling, e.g. `b.task = 2`. A compiled module does not
    recompile when `b.task` changes: `forward` reads the task as a tensor.

    Examples:
        >>> b = gb.Bottleneck(nn.Linear(64, 32), tile=(16, 16))
        >>> b(torch.randn(2, 64)).shape
        torch.Size([2, 32])
        >>> # the g-nets and free params
        >>> opt = torch.optim.AdamW(b.parameters(), lr=1e-3)
    """

    def __init__(
        self, model: nn.Module, plan: Plan | None = None, *, seed: int = 0, **plan_options: Any
    ) -> None:
        """Plan `model` (unless `plan` is given) and draw its g-nets with `gb.init`.

        Args:
            model: The p-net, a plain `nn.Module` (not wrapped in DDP or torch.compile).
            plan: From `gb.plan(model, ...)`; default `gb.plan(model, **plan_options)`.
            seed: Seed of `gb.init`.
            **plan_options: Options of `gb.plan` (`tile`, `compression`, `hidden`, ...),
                when no `plan` is given; a misspelt one raises a `TypeError` naming the
                nearest.
        """
        super().__init__()
        check_module(model, "gb.Bottleneck")
        if isinstance(model, Bottleneck):
            raise TypeError("gb.Bottleneck: model is already a gb.Bottleneck; pass its .pnet.")
        if plan is None:
            _check_plan_options(plan_options)
            plan = make_plan(model, **plan_options)
        elif plan_options:
            raise TypeError(
                f"gb.Bottleneck: pass either plan or plan options, not both; got plan and "
                f"{sorted(plan_options)}."
            )
        elif not isinstance(plan, Plan):
            raise TypeError(
                f"gb.Bottleneck: plan must be a gb.Plan (from gb.plan), got {type(plan).__name__}."
            )
        else:
            check_matches(plan, model, "gb.Bottleneck", "the plan")
        object.__setattr__(self, "_pnet", model)  # a plain attribute: not a submodule
        self._plan = plan
        first = model.get_parameter(plan.generated[0].name)
        # A p-net on the meta device is fine (its dense weights are never read); ours are real.
        device = None if first.is_meta else first.device
        gparams = init(plan, seed=seed, model=model, device=device)
        self.stacks = nn.ModuleDict(
            {escape(key): _parameter_dict(leaves) for key, leaves in gparams["stacks"].items()}
        )
        self.free = _parameter_dict(gparams["free"])
        frozen = {n: t.detach() for n, t in gparams["frozen"].items()}
        self.frozen = _Buffers(frozen, dict.fromkeys(frozen, True))
        # One entry per distinct buffer; every alias of it is re-pointed by `_link_buffers`.
        buffers: dict[str, Tensor] = {}
        persistent: dict[str, bool] = {}
        self._buffer_aliases: dict[str, list[str]] = {}
        first_name: dict[int, str] = {}
        for name, buf in model.named_buffers(remove_duplicate=False):
            keep = is_persistent(model, name)
            canonical = first_name.setdefault(id(buf), name)
            if canonical == name:
                buffers[name], persistent[name] = buf, keep
            persistent[canonical] = persistent[canonical] or keep
            self._buffer_aliases.setdefault(canonical, []).append(name)
        self.pnet_buffers = _Buffers(buffers, persistent)
        if TASKS in gparams:
            self.tasks = nn.Parameter(gparams[TASKS].detach(), requires_grad=True)
        self.condition: Tensor | None = None  # what `forward` generates for, if conditioned
        self._task: int | None = None
        # `forward`'s view of `_task`: a 0-d tensor, whose value `torch.compile` does not
        # specialise on (an int attribute would recompile the module for every task).
        self._task_index: Tensor | None = None
        self.register_load_state_dict_post_hook(_relink)  # `assign=True` replaces buffers
        self.train(model.training)

    @property
    def pnet(self) -> nn.Module:
        """The p-net (not a submodule; its dense parameters are not used by `forward`)."""
        return self._pnet

    @property
    def plan(self) -> Plan:
        """The plan, naming this module's p-net as its model (also in a copy of the module),
        so that `gb.save(path, b.gparams, b.plan)` stores the p-net's buffers."""
        if self._plan.model() is not self._pnet:  # `source` is not part of a plan's equality
            self._plan = self._plan.naming(self._pnet)
        return self._plan

    @property
    def task(self) -> int | None:
        """The task embedding `forward`, `export` and `calibrate` generate for (None: none)."""
        return self._task

    @task.setter
    def task(self, task: int | None) -> None:
        if task is not None:
            count = self._plan.tasks
            if not count:
                raise ValueError(
                    "gb.Bottleneck.task: this module has no task embeddings; make it with "
                    "gb.Bottleneck(model, condition=<width>, tasks=<n>), or set b.condition."
                )
            number = None if isinstance(task, bool) else as_integer(task)
            if number is None or not 0 <= number < count:
                raise ValueError(
                    f"gb.Bottleneck.task must be an int in 0..{count - 1} or None, got {task!r}."
                )
            task = number
        self._task = task
        self._task_index = None if task is None else torch.tensor(task, device=self.tasks.device)

    @property
    def gparams(self) -> GParams:
        """The functional view, `{"stacks", "free", "frozen"}` (and `"tasks"`, where the plan
        has task embeddings), holding this module's tensors.

        The leaves are this module's parameters and buffers themselves (no copies), so
        `gb.apply(b.gparams, b.plan)` and `gb.save(path, b.gparams, b.plan)` see its
        current values, and an optimizer built on `gb.trainable_leaves(b.gparams)` trains it.
        """
        return {
            "stacks": {
                unescape(key): {unescape(n): t for n, t in leaves.items()}
                for key, leaves in self.stacks.items()
            },
            "free": {unescape(n): t for n, t in self.free.items()},
            "frozen": {unescape(n): t for n, t in self.frozen._buffers.items()},
            **({TASKS: self.tasks} if self._plan.tasks else {}),
        }

    @_WithPnetSignature
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Generate the p-net's weights and call it: `functional_call(pnet, weights, args)`.

        Returns whatever the p-net returns (a transformers model: its `ModelOutput`). On an
        instance, `inspect.signature(b.forward)` is the p-net's, so trainers that choose
        their inputs by it (transformers' `Trainer` drops unnamed dataset columns) see the
        wrapped model's arguments.
        """
        self._check_condition_set()
        if _checkpointing(self._pnet):
            raise ValueError(_CHECKPOINTING)
        tensors = apply(self.gparams, self._plan, condition=self.condition, task=self._task_index)
        for name in self._buffer_aliases:
            tensors[name] = self.pnet_buffers.get(name)
        return functional_call(self._pnet, tensors, args, kwargs)

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """Refused (transformers' `Trainer(gradient_checkpointing=True)` calls it): see
        `_CHECKPOINTING`."""
        raise ValueError(_CHECKPOINTING)

    gradient_checkpointing_enable = activation_checkpointing_enable  # transformers < 5's name

    def export(self) -> dict[str, Tensor]:
        """The dense `state_dict` of the p-net, `gb.export(b.gparams, b.plan, model=b.pnet)`
        (for a conditioned plan, at `b.condition` or `b.task`)."""
        self._check_condition_set()
        return export(
            self.gparams, self.plan, model=self._pnet, condition=self.condition, task=self.task
        )

    def _check_condition_set(self) -> None:
        """Raise, in the module's words, unless exactly one of `task` and `condition` is set
        where the g-nets read a condition (`gb.apply` would name its own arguments). It reads
        the task's index, not the int, which `torch.compile` would specialise on."""
        if not self._plan.condition:
            return
        if self.condition is None and self._task_index is None:
            tasks = f"b.task (0..{self._plan.tasks - 1}) or " if self._plan.tasks else ""
            raise ValueError(
                f"gb.Bottleneck: its g-nets read a condition of width {self._plan.condition}: "
                f"set {tasks}b.condition (a tensor of shape ({self._plan.condition},))."
            )
        if self.condition is not None and self._task_index is not None:
            raise ValueError(
                "gb.Bottleneck: both b.task and b.condition are set; set the other to None."
            )

    def report(self) -> Report:
        """Parameter counts and compression, `gb.report(b.plan)`."""
        return report(self.plan)

    def param_groups(self, *, free_lr: float, scale: float = 1.0) -> list[dict[str, Any]]:
        """`torch.optim` parameter groups of this module at the default learning rates,
        `gb.optim.param_groups(b.gparams, b.plan, free_lr=free_lr, scale=scale)`.

        Examples:
            >>> net = gb.Bottleneck(nn.Linear(64, 32), tile=(16, 16))
            >>> opt = torch.optim.AdamW(net.param_groups(free_lr=1e-3))
        """
        return param_groups(self.gparams, self.plan, free_lr=free_lr, scale=scale)

    def calibrate(self, *inputs: Tensor) -> None:
        """Shift biases so every layer starts at zero-mean outputs on `inputs`, in place.

        `gb.calibrate` on this module's g-nets, e.g. `b.calibrate(next(iter(loader))[0])`
        before training: untrained g-nets can generate layers that are dead behind a ReLU.
        A conditioned module calibrates for its `condition` or `task`, as its forward runs.
        """
        check_inputs(inputs, "gb.Bottleneck.calibrate")  # named for this call, not gb.calibrate
        self._check_condition_set()
        calibrated = calibrate(
            self.gparams, self.plan, self._pnet, inputs, condition=self.condition, task=self.task
        )
        self.load_gparams(calibrated)

    def load_gparams(self, gparams: GParams) -> None:
        """Copy `gparams` (e.g. `gb.load(...).gparams`) into this module's tensors, in place.

        In place, so an optimizer built on `b.parameters()` keeps training the same tensors;
        values are cast to each tensor's dtype and device.
        """
        check_gparams(gparams, self.plan, "gb.Bottleneck.load_gparams")
        mine = self.gparams
        with torch.no_grad():
            for keys in expected_shapes(self.plan):
                dst, src = mine, gparams
                for k in keys:
                    dst, src = dst[k], src[k]
                dst.copy_(src)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, model: nn.Module, *, device: torch.device | str | None = None
    ) -> "Bottleneck":
        """A `Bottleneck` of `model` holding a `gb.save` checkpoint's plan and values, with
        the p-net buffers stored in it restored into `model`'s (which it shares).

        For the optimizer state, step and meta of the same file, read it with `gb.load`.

        Examples:
            >>> model = nn.Linear(64, 32)
            >>> b = gb.Bottleneck(model, tile=(16, 16))
            >>> gb.save("ckpt.safetensors", b.gparams, b.plan)
            >>> b2 = gb.Bottleneck.from_checkpoint("ckpt.safetensors", model)
            >>> x = torch.ones(1, 64)
            >>> torch.equal(b2(x), b(x))
            True
        """
        ckpt = load(path, model, device=device)
        module = cls(model, ckpt.plan)
        if device is not None:
            module.to(device)
        module.load_gparams(ckpt.gparams)
        return module

    def train(self, mode: bool = True) -> "Bottleneck":
        """Set training mode here and in the p-net (BatchNorm and dropout live there)."""
        super().train(mode)
        self._pnet.train(mode)
        return self

    def _apply(self, fn, recurse: bool = True):  # nn.Module's signature
        """`.to()`, `.half()`, ...: convert this module's tensors, then share buffers again.

        The task's index and the condition, plain attributes (not buffers: DDP would
        broadcast rank 0's over each rank's own), follow the g-nets' device. The index is
        made again from `task`, not converted by `fn`: `to_empty` would leave it garbage,
        `.double()` a float."""
        super()._apply(fn, recurse)
        self._link_buffers()
        if self._task is not None:
            self._task_index = torch.tensor(self._task, device=self.tasks.device)
        if self.condition is not None:  # a conditioned genome has its `w_cond` parameters
            device = next(self.parameters()).device
            self.condition = self.condition.to(device)
        return self

    def _link_buffers(self) -> None:
        """Point each p-net buffer (and its aliases) at the tensor registered here."""
        for canonical, names in self._buffer_aliases.items():
            tensor = self.pnet_buffers.get(canonical)
            for name in names:
                owner, _, local = name.rpartition(".")
                self._pnet.get_submodule(owner)._buffers[local] = tensor

    def __prepare_scriptable__(self) -> "Bottleneck":
        """Refuse `torch.jit.script` (which calls this first) with what to use instead."""
        raise TypeError(
            "torch.jit.script(gb.Bottleneck): TorchScript is not supported (forward generates "
            "the weights and calls the p-net through torch.func.functional_call, which "
            "TorchScript cannot compile); use torch.export.export(b.eval(), args) or "
            "torch.compile(b), or script the dense model: model.load_state_dict(b.export())."
        )

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether the p-net takes loss keywords (read by transformers' `Trainer`)."""
        found = getattr(self._pnet, "accepts_loss_kwargs", None)
        if isinstance(found, bool):
            return found
        params = inspect.signature(self._pnet.forward).parameters.values()
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)

    def extra_repr(self) -> str:
        rep = report(self.plan)
        return (
            f"pnet={type(self._pnet).__name__}, generated={len(self.plan.generated)}, "
            f"stacks={len(self.plan.stacks)}, stored={rep.stored_params:,}, "
            f"compression={rep.compression:.2f}x"
        )


def _relink(module: Bottleneck, incompatible_keys: object) -> None:
    module._link_buffers()  # a module-level function, so the module still pickles


def _parameter_dict(tensors: dict[str, Tensor]) -> nn.ParameterDict:
    """Parameters under escaped names, in `tensors`' order (a plain dict would be sorted)."""
    out = nn.ParameterDict()
    for name, t in tensors.items():
        out[escape(name)] = nn.Parameter(t.detach(), requires_grad=True)
    return out


def _check_plan_options(options: dict[str, Any]) -> None:
    """Raise `TypeError` for an option `gb.plan` does not take, naming the nearest one."""
    known = [n for n in inspect.signature(make_plan).parameters if n != "model"]
    for name in options:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise TypeError(
                f"gb.Bottleneck: unknown option {name!r}; {hint}gb.plan's options are "
                f"{', '.join(known)}."
            )
