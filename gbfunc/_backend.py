"""The Triton path of `gb.apply`: whether its kernels can run here, and running them.

`gbfunc._dispatch` decides when it is taken. Triton is optional: `gbfunc.kernels` (and with
it `triton`) is imported only when the kernels run.
"""

import importlib.util
from collections.abc import Mapping

import torch
from torch import Tensor

from ._plan import Plan
from ._spec import Terms

BACKENDS = ("auto", "torch", "triton")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_triton(key: str, leaves: Mapping[str, Tensor], backend: str) -> None:
    """Raise where the kernels cannot generate the stack `key` from its `leaves` (the
    dispatcher has chosen them: CUDA tensors with `backend="auto"`, or `backend="triton"`).

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
    from . import kernels  # triton is optional: import it only when used

    kernels.check_runnable("gb.apply", w_in.device)
    if w_in.dtype not in kernels.DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in kernels.DTYPES)
        raise TypeError(
            f"gb.apply: gparams['stacks'][{key!r}] has dtype {w_in.dtype}; backend='triton' "
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
        # One split (its backward: one concatenation), not a slice per parameter, whose
        # backward allocates and fills a zero gradient of the whole buffer (GPU launches).
        parts = flat.split([p.numel for p in params]) if len(params) > 1 else (flat,)
        for p, part in zip(params, parts, strict=True):
            out[p.name] = part.view(p.shape)
    return out
