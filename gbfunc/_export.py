"""`gb.export` / `gb.save_dense`: the ordinary dense weights, for serving anywhere."""

import os
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ._apply import apply
from ._check_gparams import check_gparams, leaves
from ._check_model import check_matches
from ._checkpoint import write_file
from ._checkpoint_checks import checkpoint_path
from ._condition import condition_of
from ._files import check_no_meta, standalone
from ._plan import Free, Plan
from ._tree import GParams


def export(
    gparams: GParams,
    plan: Plan,
    *,
    model: nn.Module | None = None,
    condition: Tensor | None = None,
    task: int | None = None,
) -> dict[str, Tensor]:
    """Materialise the dense weights that `gparams` generate, as a `state_dict`.

    Args:
        gparams: From `gb.init(plan)` (or trained from it). Under `gb.dist.ShardedFree`,
            `sharded.state(gparams)`, which holds the trained free parameters, as shards:
            they are gathered whole, a collective, so call it on every rank.
        plan: The plan that made `gparams`.
        model: The p-net. With it the result is exactly `model.state_dict()`'s keys (tied
            aliases such as GPT-2's `lm_head.weight`, and buffers copied from `model`), so
            `model.load_state_dict(sd, strict=True)` works; without it, one entry per plan
            parameter.
        condition: For a conditioned plan, the condition whose weights to export, as in
            `gb.apply`.
        task: Or the task whose weights to export.

    Returns:
        `{name: Tensor}`, detached, each parameter in the dtype the p-net had.

    Examples:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> sd = gb.export(gb.init(plan), plan, model=model)
        >>> # an ordinary model again
        >>> nn.Linear(64, 32).load_state_dict(sd, strict=True)
        <All keys matched successfully>
    """
    return _exported(gparams, plan, model, condition, task, "gb.export")


def _exported(
    gparams: GParams,
    plan: Plan,
    model: nn.Module | None,
    condition: Tensor | None,
    task: int | None,
    where: str,
) -> dict[str, Tensor]:
    """`export`'s work, its errors named for the call `where` (`gb.export`, `gb.save_dense`)."""
    check_gparams(gparams, plan, where)
    check_no_meta(leaves(gparams, plan), where)
    if model is not None:
        check_matches(plan, model, where, "the plan")
    condition_of(gparams, plan, condition, task, where)  # named for this call
    with torch.no_grad():  # once: not worth compiling
        params = apply(gparams, plan, condition=condition, task=task, compile=False)
    dense: dict[str, Tensor] = {}
    for p in plan.params:
        value = params[p.name].detach()
        if isinstance(value, DTensor):  # a shard (`ShardedFree.state`): gathered, collectively
            value = value.full_tensor()
        value = value.to(getattr(torch, p.dtype))
        dense[p.name] = value.clone() if isinstance(p, Free) else value  # free ones alias gparams
    if model is None:
        return dense
    # Tied parameters appear once in the plan (first name) and under every alias here.
    canonical = {id(param): name for name, param in model.named_parameters()}
    state = model.state_dict(keep_vars=True)
    empty = next((k for k, v in state.items() if _on_meta(v)), None)
    if empty is not None:  # (the plan's own tensors are real: gb.init drew them)
        raise ValueError(
            f"{where}: the model's {empty!r} is on the meta device, with no values to "
            "export; pass a model whose buffers hold values (e.g. built on the CPU)."
        )
    return {
        key: dense[canonical[id(value)]] if id(value) in canonical else _copy(value)
        for key, value in state.items()
    }


def save_dense(
    path: str | os.PathLike,
    gparams: GParams,
    plan: Plan,
    *,
    model: nn.Module | None = None,
    metadata: dict[str, str] | None = None,
    condition: Tensor | None = None,
    task: int | None = None,
) -> None:
    """Write `gb.export(gparams, plan, model=model)` as an ordinary safetensors file, atomically.

    Tied aliases are stored as separate copies, so `load_state_dict(strict=True)` needs no
    tie-aware loader. The header carries `{"format": "pt"}` (what `transformers` expects)
    plus `metadata`; `condition` or `task` choose a conditioned plan's weights, as in
    `gb.export`. A path no file can have, or one that cannot be written (a missing
    folder, a full disk), raises a `gb.CheckpointError` naming it, as `gb.save` does.

    Args:
        path: Target file, conventionally `*.safetensors`.
        gparams: From `gb.init(plan)` (or trained from it). Under `gb.dist.ShardedFree`,
            `sharded.state(gparams)`, which holds the trained free parameters, as shards:
            they are gathered whole, a collective, so call it on every rank.
        plan: The plan that made `gparams`.
        model: The p-net. With it the file holds exactly `model.state_dict()`'s keys (tied
            aliases as copies, buffers copied from `model`), as `gb.export` returns them;
            without it, one entry per plan parameter.
        metadata: Extra `{str: str}` entries for the file's header, beside
            `{"format": "pt"}`. Default: none.
        condition: For a conditioned plan, the condition whose weights to write, as in
            `gb.apply`.
        task: Or the task whose weights to write.

    Examples:
        >>> import safetensors.torch
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> gb.save_dense("model.safetensors", gb.init(plan), plan, model=model)
        >>> model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
        <All keys matched successfully>
    """
    path = checkpoint_path(path, "gb.save_dense")
    if metadata is not None and not (
        isinstance(metadata, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise TypeError(
            f"gb.save_dense: metadata must map str to str (safetensors' header), got {metadata!r}."
        )
    if metadata is not None and metadata.get("format", "pt") != "pt":
        raise ValueError(
            f"gb.save_dense: metadata['format'] is {metadata['format']!r}; the header's "
            "'format' says how to read the file and is 'pt' (torch), so leave it out."
        )
    state = _exported(gparams, plan, model, condition, task, "gb.save_dense")
    for key, value in state.items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"gb.save_dense: state_dict entry {key!r} is a {type(value).__name__}; "
                "safetensors holds tensors only."
            )
    tensors = standalone(state)
    header = {"format": "pt", **(metadata or {})}
    write_file(path, tensors, header, "gb.save_dense")


def _on_meta(value: object) -> bool:
    """Whether state_dict entry `value` has no values (meta), counting only what `export`
    copies from the model: not its parameters, which the plan gives."""
    return isinstance(value, Tensor) and value.is_meta and not isinstance(value, nn.Parameter)


def _copy(value: object) -> object:
    return value.detach().clone() if isinstance(value, Tensor) else value
