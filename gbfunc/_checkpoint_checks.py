"""The checks a checkpoint passes on both sides: `gb.save` runs them before it writes a byte,
`gb.load` after it reads the file, so that what is written is what can be loaded.

`check_checkpoint` is that one validator: the plan (every field, and against the model's
parameters) and the p-net's buffers (against the model's). `gb.save` gives it the model the
checkpoint is for (the module passed as `buffers=`, else the plan's model), `gb.load` the
model it is given. The errors of both sides are defined here.
"""

import os
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from ._buffers import persistent_buffers
from ._check_model import check_matches
from ._check_plan import check_plan
from ._files import check_no_meta
from ._plan import Plan


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


class CheckpointUnreadableError(CheckpointError):
    """Something is at the checkpoint's path but cannot be read: no permission, an I/O error,
    a directory. Not a `FileNotFoundError`, so that code which starts afresh where no
    checkpoint exists does not then save over one it could not read."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, altered (hash mismatch) or not a gbfunc checkpoint."""


class CheckpointVersionError(CheckpointError):
    """The file was written in a format version this gbfunc cannot read."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was made for a different model (or different g-nets)."""


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as checkpoints record it (`torch.optim.adamw.AdamW`): another
    optimizer's state loads into one without error (torch checks the groups' sizes only) and
    fails at its first step, or trains on with foreign settings."""
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def checkpoint_path(path: object, where: str) -> str:
    """`path` as a string, or a `CheckpointError` naming it where no file can have it."""
    try:
        text = os.fspath(path)
    except TypeError:
        raise CheckpointError(
            f"{where}: path must be a str or os.PathLike, got {type(path).__name__}."
        ) from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise CheckpointError(f"{where}: path {text!r} contains a NUL byte; no file has that name.")
    return text


def check_checkpoint(
    plan: Plan,
    model: nn.Module | None,
    buffers: Mapping[str, Tensor],
    where: str,
    *,
    corrupt: type[CheckpointError],
) -> None:
    """Raise unless `plan` is a well-formed plan of `model` and `buffers` fit `model`'s.

    Args:
        plan: The checkpoint's plan.
        model: The p-net the checkpoint is for; None (a save whose model is gone): the plan's
            own consistency only.
        buffers: The checkpoint's p-net buffers, by name.
        where: Prefix of messages, e.g. `"gb.load: ckpt.safetensors"`.
        corrupt: Exception class for a malformed plan (`gb.CheckpointCorruptError` for a
            file; `gb.CheckpointError` for a plan about to be saved).
    """
    check_plan(plan, model, where, corrupt=corrupt, mismatch=CheckpointMismatchError)
    if model is None:
        _check_buffer_names(plan, buffers, where)
        return
    mine = persistent_buffers(model)
    for name, value in buffers.items():
        check_buffer(name, value.dtype, tuple(value.shape), mine, where)


def _check_buffer_names(plan: Plan, buffers: Mapping[str, Tensor], where: str) -> None:
    """Without the model, what the plan knows: a buffer may not be one of its parameters (a
    whole `state_dict` passed as buffers), nor, where the plan named its model's buffers
    (`Plan.buffer_names`, kept by copies and pickles), a name outside them."""
    parameters = {p.name for p in plan.params}
    for name in buffers:
        if name in parameters:
            raise CheckpointMismatchError(
                f"{where}: buffers holds {name!r}, a parameter of the plan, not a buffer: pass "
                "the model's buffers alone (a state_dict holds its parameters too)."
            )
        if plan.buffer_names and name not in plan.buffer_names:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint holds buffer {name!r}, which the plan's model did not "
                f"have (it had {', '.join(map(repr, plan.buffer_names))})."
            )


def check_buffer(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], mine: dict[str, Tensor], where: str
) -> None:
    """Raise `CheckpointMismatchError` unless a stored buffer fits the model's of that name:
    its shape, and its dtype, or any floating dtype for a floating buffer (cast on restore, as
    `load_state_dict` casts: a half-precision model's statistics load into a float32 one)."""
    if name not in mine:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint holds buffer {name!r}, which the model does not have "
            "(or does not store in its state_dict). Was it made for a different model?"
        )
    have = mine[name]
    castable = dtype == have.dtype or (dtype.is_floating_point and have.dtype.is_floating_point)
    if shape != tuple(have.shape) or not castable:
        raise CheckpointMismatchError(
            f"{where}: buffer {name!r} is {dtype} {shape} in the checkpoint but "
            f"{have.dtype} {tuple(have.shape)} in the model."
        )


def check_restorable(model: nn.Module, names: Iterable[str], where: str) -> None:
    """Raise `CheckpointMismatchError` where one of `model`'s buffers `names` is on the meta
    device: copying into it does nothing, and the stored values would be lost unsaid."""
    name = next((n for n in sorted(names) if model.get_buffer(n).is_meta), None)
    if name is not None:
        raise CheckpointMismatchError(
            f"{where}: the model's buffer {name!r} is on the meta device, which holds no "
            "values to restore into: materialise the model first "
            "(model.to_empty(device=...)), then load."
        )


def buffers_to_save(
    buffers: nn.Module | Mapping[str, Tensor] | None, plan: Plan, where: str, stacklevel: int = 2
) -> dict[str, Tensor]:
    """The p-net buffers a save stores, once `check_checkpoint` finds the checkpoint loadable
    into the model it is for.

    `buffers` is a module (its persistent buffers; a `gb.Bottleneck`'s are its p-net's) or
    `{name: tensor}`; None takes the plan's model's, and stores none, with a warning, where
    that model had buffers and is gone. The model checked against is the module given, else
    the plan's model (if alive). `stacklevel` is the warning's, counted from the caller (2:
    the caller's caller, as for `gb.save`).
    """
    if buffers is None:
        buffers = plan.model()
        if buffers is None:
            _warn_unstored(plan, where, stacklevel + 2)
            buffers = {}
    elif isinstance(buffers, nn.Module):  # checked here too, for a message naming `buffers`
        at = f"{where}: buffers={type(buffers).__name__} is not the model of this plan"
        buffers = _pnet_of(buffers)
        check_matches(plan, buffers, at, "the plan", CheckpointMismatchError)
    if isinstance(buffers, nn.Module):
        model, found = buffers, persistent_buffers(buffers)
    elif isinstance(buffers, Mapping):
        model, found = plan.model(), dict(buffers)
        for name, t in found.items():
            if not isinstance(name, str) or not isinstance(t, Tensor):
                raise TypeError(
                    f"{where}: buffers must map names (str) to tensors; got {name!r}: "
                    f"{type(t).__name__}."
                )
    else:
        raise TypeError(
            f"{where}: buffers must be an nn.Module, a {{name: tensor}} mapping or None, got "
            f"{type(buffers).__name__}."
        )
    remedy = "Pass buffers= a model (or {name: tensor}) that holds them."
    check_no_meta({f"buffer {n!r}": t for n, t in found.items()}, where, remedy)
    check_checkpoint(plan, model, found, where, corrupt=CheckpointError)
    return {n: t.detach() for n, t in found.items()}


def _pnet_of(module: nn.Module) -> nn.Module:
    """The p-net whose buffers `module` holds: a `gb.Bottleneck`'s, or `module` itself."""
    from ._module import Bottleneck  # here, not above: `_module` imports this module

    return module.pnet if isinstance(module, Bottleneck) else module


def _warn_unstored(plan: Plan, where: str, stacklevel: int) -> None:
    """Warn that a default save stores no buffers because the plan's model, which had some,
    is gone (a plan that names no model and knows of no buffers stores none silently)."""
    if not plan.buffer_names:
        return
    names = ", ".join(map(repr, plan.buffer_names[:3]))
    more = ", ..." if len(plan.buffer_names) > 3 else ""
    warnings.warn(
        f"{where}: the model this plan names is gone, so its buffers ({names}{more}) are not "
        "stored. Pass buffers=model (the p-net) to store them, or buffers={} to store none.",
        RuntimeWarning,
        stacklevel=stacklevel,  # the caller of gb.save (or gb.dist.save_sharded)
    )
