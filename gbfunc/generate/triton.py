"""The `triton` path: fused Triton kernels, g-nets to weights, forward and backward.

Taken for CUDA tensors with `triton` installed (`backend="auto"`), or wherever
`backend="triton"` asks for it (on CPU: Triton's interpreter, eagerly only); a whole plan
goes through it, never a selection. Triton is optional: gbfunc imports `gbfunc.kernels`
(and with it `triton`) only when the kernels are checked or run (`torch._dynamo`, which
gbfunc's import loads, imports `triton` itself where it is installed).
"""

import importlib.util
from collections.abc import Mapping

import torch
from torch import Tensor

from .._plan import Plan
from .._spec import stack_terms
from .._tiling import assemble, center_rows
from ._policy import PLAIN_ONLY, Call
from .torch_ops import hashed_tiles

NAME = "triton"
FUSED = "fused"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def refuses(call: Call) -> str | None:
    """Why the kernels do not generate the call's stack (None: they do).

    With `backend="auto"` every limit is a reason, so such a stack takes the next path that
    applies (`torch` at the latest); with
    `backend="triton"` the same limits raise (`_unrunnable`'s error), since nothing else may
    run it.
    """
    context = call.context
    if context.backend == "torch":
        return "backend='torch'"
    device = _device(call)  # each stack's own: gparams may span devices
    if context.backend == "auto":
        if device != "cuda":
            return f"backend='auto' takes Triton for CUDA tensors; these are on {device}"
        if not HAS_TRITON:
            return "triton is not installed (pip install 'gbfunc[triton]')"
    if call.plan is None:
        return "a selection of a plan is generated in torch"
    unrunnable = _unrunnable(call)
    if unrunnable is None:
        return None
    reason, error = unrunnable
    if context.backend == "triton":
        raise error
    return reason


def variant(call: Call) -> str:
    """The one variant: each stack one fused kernel forward and one backward, launched as
    `torch.library.triton_op` ops (`gbfunc.kernels`)."""
    return FUSED


def _unrunnable(call: Call) -> tuple[str, Exception] | None:
    """Why the kernels cannot generate the call's stack here, and the error that
    `backend="triton"` raises for it (None: they can)."""
    context, key, device = call.context, call.stack.key, _device(call)
    if context.forward_ad:
        return "forward-mode AD is active: the kernels have no forward-mode rule", ValueError(
            "gb.apply: backend='triton' has no forward-mode rule (torch.func.jvp, jacfwd, "
            "torch.autograd.forward_ad); use backend='torch' (or 'auto', which sends it there)."
        )
    if context.plain:
        return PLAIN_ONLY, ValueError(
            "gb.apply: backend='triton' is not traced by torch.compile differentiated twice "
            "(grad of grad, MAML), in forward mode (jvp, jacfwd, hessian) or as a grad inside a "
            "vmap, where dynamo mis-traces custom autograd rules (torch 2.13); use "
            "backend='auto' (which generates it in plain torch ops there) or call it eagerly."
        )
    if not HAS_TRITON:
        return "triton is not installed", ModuleNotFoundError(
            "gb.apply: backend='triton' needs the triton package: pip install 'gbfunc[triton]'."
        )
    if device not in ("cuda", "cpu"):
        return f"the g-nets are on {device}", ValueError(
            f"gb.apply: gparams['stacks'][{key!r}] is on {device}; the Triton kernels take CUDA "
            "or CPU tensors. Use backend='torch' (on meta it generates shapes alone)."
        )
    if device != "cuda" and context.compiling:
        return "Triton's interpreter cannot be traced", ValueError(
            "gb.apply: backend='triton' on CPU runs Triton's interpreter, which torch.compile "
            "cannot trace; compile with backend='auto' or 'torch' (the pure-torch path), or call "
            "it eagerly."
        )
    from .. import kernels  # triton is optional: import it only when used

    try:
        kernels.check_runnable("gb.apply", torch.device(device))
    except RuntimeError as error:
        return "the kernels cannot run in this process", error
    reason = kernels.refusal(call.stack, call.leaves["w_out"].dtype)  # stacks' dtypes may differ
    if reason is None:
        return None
    error = TypeError if reason.startswith("dtype") else ValueError
    return reason, error(
        f"gb.apply: gparams['stacks'][{key!r}] has {reason}; backend='triton' cannot generate "
        "it. Use backend='torch' (or 'auto', which sends it there)."
    )


def _device(call: Call) -> str:
    """The device type of the call's stack's g-nets."""
    return call.leaves["w_out"].device.type


def stack_weights(
    plan: Plan, index: int, leaves: Mapping[str, Tensor], form: str, traced: bool
) -> dict[str, Tensor]:
    """The runner: `{name: weight}` of the parameters stack `index` of `plan` generates, by
    one fused kernel on its g-nets' `leaves` (`form`: the one variant, `FUSED`): views of the
    one buffer it wrote, centred and with the hashed table added where the plan says (both
    read whole rows or tiles, so done here; `traced`: by `torch.compile`)."""
    from .. import kernels  # triton is optional: import it only when used

    stack = plan.stacks[index]
    params = plan.generated_by(index)
    flat = kernels.generate(stack_terms(stack, leaves), stack, params)  # (numel,)
    # One split (its backward: one concatenation), not a slice per parameter, whose backward
    # allocates and fills a zero gradient of the whole buffer (GPU launches).
    parts = flat.split([p.numel for p in params]) if len(params) > 1 else (flat,)
    # linear in the tiles, so laid out on its own and added to the kernel's
    hashed = hashed_tiles(stack, leaves["tile_hash"], traced) if stack.genome.hashed else None
    weights = {}
    for p, part in zip(params, parts, strict=True):
        weight = part.view(p.shape)
        if p.center:
            weight = center_rows(weight)
        if hashed is not None:
            weight = weight + assemble(p, stack, hashed)
        weights[p.name] = weight
    return weights
