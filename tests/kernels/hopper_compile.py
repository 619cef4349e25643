"""Compile the fused kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's compiler and ptxas run anywhere, and they reject code that the interpreter runs
happily (the interpreter executes the kernel as Python): a `return` inside a constexpr `if`
followed by more code, a `tl.dot` on a vector. Run as a script in a process that did not
set TRITON_INTERPRET; prints `{variant: error}` as JSON, `{}` when everything compiled.

Every constexpr branch and every block size and warp count of each kernel's autotune configs
is compiled; not every specialisation a launch makes (integer arguments equal to 1 become
constants, pointers and sizes divisible by 16 get alignment hints).
"""

import json
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gbfunc.kernels import _gnet
from gbfunc.kernels.generate import kernel as forward
from gbfunc.kernels.generate_backward import kernel as backward

HOPPER = GPUTarget("cuda", 90, 32)
SIZES = ("NUM_TILES", "NUMEL", "TH", "Q", "H")
# Pointers that are always float32 or int64, whatever the g-net's dtype.
FIXED_POINTERS = {"place_ptr": "*i64", "scale_ptr": "*fp32"}
FLOAT32_GRADIENTS = ("ga_ptr", "gb_ptr", "gwh_ptr", "gbh_ptr", "gwo_ptr", "gbo_ptr")
HIDDEN_LAYER_POINTERS = ("wh_ptr", "bh_ptr", "gwh_ptr", "gbh_ptr")

# (dtype, outputs, depth, activation, dot precision, rows, columns, hidden): every branch of
# the kernels' constexprs at least once, ragged and power-of-two shapes.
VARIANTS = [
    ("fp32", 1, 1, "relu", "ieee", 8, 5, 17),
    ("fp32", 1, 2, "gelu", "ieee", 64, 64, 32),
    ("fp16", 1, 3, "tanh", "tf32", 8, 5, 8),
    ("bf16", 3, 2, "silu", "tf32", 16, 24, 32),
    ("fp32", 16, 1, "relu", "tf32", 64, 64, 32),
]


def jit_function(kernel) -> triton.runtime.jit.JITFunction:
    """The `@triton.jit` function under `@triton.autotune` and `@triton.heuristics`."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def compile_variant(
    kernel, config, dtype, outputs, depth, activation, precision, th, q, hidden
) -> None:
    """Compile one specialisation under one autotune config, constexprs as the launcher sets."""
    block_n = config.kwargs["BLOCK_N"]
    fn = jit_function(kernel)
    constants = {
        "P": outputs,
        "DEPTH": depth,
        "ACTIVATION": _gnet.ACTIVATIONS[activation],
        "PRECISION": precision,
        "BLOCK_H": forward.block_h(hidden, depth, outputs),
        "BLOCK_P": forward.block_p(outputs),
        "BLOCK_N": block_n,
        **forward.block_sizes({"TH": th, "Q": q, "BLOCK_N": block_n}),
    }
    if depth == 1:  # the launcher passes None for the missing hidden layers
        constants |= {n: None for n in HIDDEN_LAYER_POINTERS if n in fn.arg_names}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in SIZES:
            signature[name] = "i32"
        else:
            fixed = "*fp32" if name in FLOAT32_GRADIENTS else f"*{dtype}"
            signature[name] = FIXED_POINTERS.get(name, fixed)
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()},
    )
    triton.compile(source, target=HOPPER, options={"num_warps": config.num_warps})


def main() -> None:
    failures = {}
    for kernel in (forward._generate_kernel, backward._generate_backward_kernel):
        # The variants in turn meet the configs, each config at least once.
        for step in range(max(len(VARIANTS), len(kernel.configs))):
            variant, config = (
                VARIANTS[step % len(VARIANTS)],
                kernel.configs[step % len(kernel.configs)],
            )
            label = f"{jit_function(kernel).__name__}{variant} {config}"
            try:
                compile_variant(kernel, config, *variant)
            except Exception as error:  # report every variant, not the first failure
                failures[label] = "".join(traceback.format_exception_only(error))[-2000:]
    print(json.dumps(failures))


if __name__ == "__main__":
    main()
