"""The kernels' ops below autograd: their `autograd.Function`s differentiate them.

`torch.func.grad` cannot run `register_autograd`'s formulas (pytorch/pytorch#170834), so
`gbfunc::generate` and `gbfunc::generate_backward` are never differentiated as ops: the
Functions in `generate/` and `generate_backward/` own the gradients and `vmap`, and the ops'
autograd kernel only passes the call below autograd.
"""

import warnings

import torch

_LIBRARY = torch.library.Library("gbfunc", "IMPL")


def run_below_autograd(op: torch._ops.OpOverload) -> None:
    """Register an autograd kernel for `op` that redispatches it below autograd, replacing
    `triton_op`'s own (which would need a formula, and functorch a generated one)."""

    def kernel(keyset: torch._C.DispatchKeySet, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    with warnings.catch_warnings():  # replacing `triton_op`'s autograd kernel is the point
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        name = op.__name__.split(".")[0]
        _LIBRARY.impl(name, kernel, "Autograd", with_keyset=True, allow_override=True)
