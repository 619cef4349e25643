"""The `triton` path: fused Triton kernels, g-nets to weights, forward and backward.

Taken for CUDA tensors with `triton` installed (`backend="auto"`), or wherever
`backend="triton"` asks for it (on CPU: Triton's interpreter, eagerly only); a whole plan
goes through it, never a selection. Triton is optional: `gbfunc.kernels` (and with it
`triton`) is imported only when the kernels are checked or run.
"""

import importlib.util
from collections.abc import Mapping

import torch
from torch import Tensor

from .._evaluate import hashed_tiles
from .._plan import Plan
from .._spec import Terms, stack_terms
from .._tiling import assemble, center_rows, parameters
from .._tree import GParams
from ._policy import Call

NAME = "triton"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def refuses(call: Call) -> str | None:
    """Why the kernels do not generate the call's stack (None: they do); raises where
    `backend` chose them and they cannot run (`_check_runnable`)."""
    context = call.context
    if context.backend == "torch":
        return "backend='torch'"
    if context.backend == "auto":
        if context.device != "cuda":
            return f"backend='auto' takes Triton for CUDA tensors; these are on {context.device}"
        if not HAS_TRITON:
            return "triton is not installed (pip install 'gbfunc[triton]')"
    if call.plan is None:
        return "a selection of a plan is generated in torch"
    _check_runnable(call.stack.key, call.leaves)
    return None


def variant(call: Call) -> None:
    """None: the kernels have one form."""
    return None


def _check_runnable(key: str, leaves: Mapping[str, Tensor]) -> None:
    """Raise where the kernels cannot generate the stack `key` from its `leaves` (the rule has
    chosen them: CUDA tensors with `backend="auto"`, or `backend="triton"`).

    Raises:
        ModuleNotFoundError: `"triton"` without the `triton` package.
        ValueError: `"triton"` on CPU inside `torch.compile` (the interpreter cannot trace).
        TypeError: A stack in a dtype the kernels lack.
        RuntimeError: `"triton"` on CPU in a process that did not enable Triton's
            interpreter (`TRITON_INTERPRET=1` before triton is imported).
    """
    if not HAS_TRITON:
        raise ModuleNotFoundError(
            "gb.apply: backend='triton' needs the triton package: pip install 'gbfunc[triton]'."
        )
    w_in = leaves["w_in"]  # `check_gparams` made a stack's leaves share dtype and device
    if not w_in.is_cuda and torch.compiler.is_compiling():
        raise ValueError(
            "gb.apply: backend='triton' on CPU runs Triton's interpreter, which torch.compile "
            "cannot trace; compile with backend='auto' or 'torch' (the pure-torch path), or call "
            "it eagerly."
        )
    from .. import kernels  # triton is optional: import it only when used

    kernels.check_runnable("gb.apply", w_in.device)
    if w_in.dtype not in kernels.DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in kernels.DTYPES)
        raise TypeError(
            f"gb.apply: gparams['stacks'][{key!r}] has dtype {w_in.dtype}; backend='triton' "
            f"takes {names} here. Use backend='torch'."
        )


def generate(gparams: GParams, plan: Plan) -> dict[str, Tensor]:
    """Every parameter of `plan`, the generated ones by the fused kernels, one per stack."""
    stacks = gparams["stacks"]
    generated = _fused_weights(plan, [stack_terms(s, stacks[s.key]) for s in plan.stacks])
    hashed = {  # linear in the tiles, so laid out on its own and added to the kernels'
        s.key: hashed_tiles(s, stacks[s.key]["tile_hash"]) for s in plan.stacks if s.genome.hashed
    }
    for p in plan.generated:  # the kernels scale; centring reads whole rows, done here
        stack = plan.stacks[p.stack_index]
        if p.center:
            generated[p.name] = center_rows(generated[p.name])
        if stack.key in hashed:
            generated[p.name] = generated[p.name] + assemble(p, stack, hashed[stack.key])
    return parameters(plan.params, gparams, lambda p: generated[p.name])


def _fused_weights(plan: Plan, inputs: list[Terms]) -> dict[str, Tensor]:
    """`{name: weight}` of every generated parameter, one fused kernel per stack on its g-net
    terms `inputs` (`stack_terms`, per stack); the weights of a stack are views of the one
    buffer its kernel wrote."""
    from .. import kernels  # triton is optional: import it only when used

    out: dict[str, Tensor] = {}
    for index, (stack, terms) in enumerate(zip(plan.stacks, inputs, strict=True)):
        params = tuple(p for p in plan.generated if p.stack_index == index)
        flat = kernels.generate(terms, stack, params)  # (numel,)
        # One split (its backward: one concatenation), not a slice per parameter, whose
        # backward allocates and fills a zero gradient of the whole buffer (GPU launches).
        parts = flat.split([p.numel for p in params]) if len(params) > 1 else (flat,)
        for p, part in zip(params, parts, strict=True):
            out[p.name] = part.view(p.shape)
    return out
