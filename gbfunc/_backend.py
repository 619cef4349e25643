"""Which implementation generates the weights in `gb.apply`: pure torch, or fused Triton kernels.

Triton is optional: `gbfunc.kernels` (and with it `triton`) is imported only when the Triton
backend is actually used.
"""

import importlib.util

import torch
from torch import Tensor

from ._plan import Plan
from ._tilemlp import Terms

BACKENDS = ("auto", "torch", "triton")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(backend: object, plan: Plan, stacks: dict[str, dict[str, Tensor]]) -> bool:
    """Resolve `backend` for these g-net stacks: True for the fused kernels.

    `"auto"` picks Triton for CUDA tensors (when Triton is installed) and torch otherwise.
    `"triton"` on CPU runs the kernels through Triton's interpreter, eagerly only: the
    interpreter cannot run on `torch.compile`'s fake tensors, so compiled CPU code uses torch.

    Raises:
        ValueError: Unknown backend, or `"triton"` on CPU inside `torch.compile`.
        TypeError: A stack in a dtype the kernels lack.
        ModuleNotFoundError: `"triton"` without the `triton` package.
        RuntimeError: `"triton"` on CPU in a process that did not enable Triton's
            interpreter (`TRITON_INTERPRET=1` before triton is imported).
    """
    if backend not in BACKENDS:
        raise ValueError(f"gb.apply: backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "torch":
        return False
    on_cuda = any(leaf.is_cuda for leaves in stacks.values() for leaf in leaves.values())
    if backend == "auto" and not (on_cuda and _HAS_TRITON):
        return False
    if not _HAS_TRITON:
        raise ModuleNotFoundError(
            "gb.apply: backend='triton' needs the triton package: pip install 'gbfunc[triton]'."
        )
    if not on_cuda and torch.compiler.is_compiling():
        raise ValueError(
            "gb.apply: backend='triton' on CPU runs Triton's interpreter, which torch.compile "
            "cannot trace; compile with backend='auto' or 'torch' (the pure-torch path), or call "
            "it eagerly."
        )
    _check_runnable(plan, stacks)
    return True


def _check_runnable(plan: Plan, stacks: dict[str, dict[str, Tensor]]) -> None:
    # `check_gparams` already made each stack's leaves share one dtype and device.
    from . import kernels  # triton is optional: import it only when used

    for stack in plan.stacks:
        kernels.check_runnable("gb.apply", stacks[stack.key]["w_in"].device)
        dtype = stacks[stack.key]["w_in"].dtype
        if dtype not in kernels.DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in kernels.DTYPES)
            raise TypeError(
                f"gb.apply: gparams['stacks'][{stack.key!r}] has dtype {dtype}; backend='triton' "
                f"takes {names} here. Use backend='torch'."
            )


def fused_weights(plan: Plan, inputs: list[Terms]) -> dict[str, Tensor]:
    """Every generated parameter, one fused kernel per stack.

    Args:
        plan: The plan.
        inputs: Per stack, its g-net terms from `_evaluate.stack_terms`.

    Returns:
        `{name: weight}`; the weights of a stack are views of the one buffer its kernel wrote.
    """
    from . import kernels  # triton is optional: import it only when used

    out: dict[str, Tensor] = {}
    for index, (stack, terms) in enumerate(zip(plan.stacks, inputs, strict=True)):
        params = tuple(p for p in plan.generated if p.stack_index == index)
        flat = kernels.generate(terms, stack, params)  # (numel,)
        offset = 0
        for p in params:
            out[p.name] = flat[offset : offset + p.numel].view(p.shape)
            offset += p.numel
    return out
