"""Checks on the user's p-net: that it is a plain module, and that it matches a plan."""

from torch import nn
from torch.nn.parameter import UninitializedParameter

from ._plan import Plan, check_is_plan

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def is_bottleneck(obj: object) -> bool:
    """Whether `obj` is a `gb.Bottleneck` (by its `pnet` and `plan`; not imported: it is
    built on these checks)."""
    return isinstance(getattr(obj, "pnet", None), nn.Module) and isinstance(
        getattr(obj, "plan", None), Plan
    )


def check_module(model: object, where: str) -> nn.Module:
    """Return `model` if it is a plain `nn.Module`; reject wrappers whose names differ from it.

    DDP/DataParallel prefix every name with `module.` and torch.compile with `_orig_mod.`;
    gbfunc generates weights for the module itself, so the wrapper has to be removed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}.")
    if isinstance(model, _WRAPPERS):
        raise TypeError(
            f"{where}: model is wrapped in {type(model).__name__}; pass model.module. gbfunc "
            "generates the weights itself (use gbfunc.compat.GenomicBottleneck for DDP scripts)."
        )
    if is_bottleneck(model):
        raise TypeError(
            f"{where}: model is a gb.Bottleneck, whose parameters are g-nets; pass its p-net "
            "(b.pnet) and b.plan, or use its own methods (b.report(), b.export())."
        )
    if _is_compiled(model):
        raise TypeError(
            f"{where}: model is a torch.compile'd OptimizedModule; pass model._orig_mod and "
            "compile the function that calls gb.apply instead."
        )
    lazy = next(
        (n for n, p in model.named_parameters() if isinstance(p, UninitializedParameter)), None
    )
    if lazy is not None:
        raise ValueError(
            f"{where}: parameter {lazy!r} is uninitialised (a lazy module such as "
            "nn.LazyLinear): run one forward pass on the model first, so that it has a shape."
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP, DataParallel and torch.compile wrappers, however nested."""
    while True:
        if isinstance(model, _WRAPPERS):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    # torch.compile's OptimizedModule, recognised without importing torch._dynamo.
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module
    )


def _describe(name: str, shape: tuple[int, ...]) -> str:
    return f"{name!r} {shape}"


def check_matches(
    plan: Plan,
    model: nn.Module,
    where: str,
    source: str,
    error: type[ValueError] = ValueError,
    dtypes: bool = True,
) -> None:
    """Raise `error` naming the first parameter whose name, shape or dtype differs.

    Args:
        plan: The plan to compare.
        model: The p-net; tied parameters count once, as in `gb.plan`.
        where: Prefix of the message, e.g. `"gb.load: /tmp/ckpt.safetensors"`.
        source: What the plan came from, e.g. `"the checkpoint"`.
        error: The exception class to raise.
        dtypes: Whether dtypes must match too.
    """
    check_is_plan(plan, where)
    check_module(model, where)
    theirs = [(p.name, p.shape) for p in plan.params]
    ours = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    model_dtypes = {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}
    for i, ((name, shape), (m_name, m_shape)) in enumerate(zip(theirs, ours, strict=False)):
        if name != m_name:
            raise error(
                f"{where}: parameter #{i} is {_describe(name, shape)} in {source} but "
                f"{_describe(m_name, m_shape)} in the model. Was it made for a different model?"
            )
        if shape != m_shape:
            raise error(
                f"{where}: parameter {name!r} has shape {shape} in {source} "
                f"but {m_shape} in the model."
            )
        if dtypes and plan.params[i].dtype != model_dtypes[m_name]:
            raise error(
                f"{where}: parameter {name!r} has dtype {plan.params[i].dtype!r:.40} in {source} "
                f"but {model_dtypes[m_name]!r} in the model."
            )
    if len(theirs) > len(ours):
        name, shape = theirs[len(ours)]
        raise error(
            f"{where}: parameter {_describe(name, shape)} is in {source} but not in the model."
        )
    if len(ours) > len(theirs):
        name, shape = ours[len(theirs)]
        raise error(f"{where}: the model's parameter {_describe(name, shape)} is not in {source}.")
