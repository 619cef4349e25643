"""How the kernels run on this machine: compiled for CUDA, or through Triton's interpreter.

`@triton.jit` reads `TRITON_INTERPRET` when a kernel is defined, so the mode is fixed when
`gbfunc.kernels` is imported; this module reads the variable and never sets it. The autotune
configs, the device check and the backward's parallelism follow from it.
"""

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Triton's own library (tl.sum, ...) is interpreted only if the variable was set before
# triton was first imported (torch.compile imports it, for one).
_LIBRARY_INTERPRETED = isinstance(tl.sum, InterpretedFunction)


def check_runnable(where: str, device: torch.device) -> None:
    """Raise `RuntimeError` with the fix when the kernels cannot run on `device` here.

    CUDA tensors run compiled (or interpreted, when the process asked for it); CPU tensors
    need the interpreter, enabled before triton was imported.
    """
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: tensors are on {device}; Triton kernels take CUDA or CPU.")
    if device.type == "cuda" and not INTERPRETED:
        return
    if not INTERPRETED:
        raise RuntimeError(
            f"{where}: backend='triton' on CPU runs Triton's interpreter, which this process "
            "did not enable. Start Python with TRITON_INTERPRET=1 (`TRITON_INTERPRET=1 python "
            "train.py`; it must be set before anything imports triton), or use "
            "backend='torch'."
        )
    if not _LIBRARY_INTERPRETED:
        raise RuntimeError(
            f"{where}: TRITON_INTERPRET=1 was set after triton was imported (torch.compile "
            "imports it), so Triton's own library cannot be interpreted. Set it before "
            "anything imports triton: `TRITON_INTERPRET=1 python train.py`."
        )


# The dtypes the kernels load and store; arithmetic is always float32.
DTYPES = (
    (torch.float32, torch.float16)
    if INTERPRETED
    else (torch.float32, torch.float16, torch.bfloat16)
)

# A (BLOCK_N, H) block of hidden activations lives in registers: wider g-nets spill.
MAX_HIDDEN = 256
MAX_OUTPUTS = 128


def configs(blocks: tuple[int, ...], warps: tuple[int, ...]) -> list[triton.Config]:
    """Autotune configs over positions per block and warps; one under the interpreter.

    Multi-config autotune needs a GPU to time the candidates. Blocks whose activations spill
    are timed with the others and lose: an `early_config_prune` beside `triton.heuristics`
    failed `torch.compile` on torch 2.11 ("Can't construct an AttrSource without a valid
    base source", pytorch/pytorch#178179; the H200 log of c418d6b,
    benchmarks/results/gpu_tests_function.log).
    """
    if INTERPRETED:
        return [triton.Config({"BLOCK_N": 32})]
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n in blocks for w in warps]


def target_programs(device: torch.device) -> int:
    """Programs worth launching at once: enough to fill every SM a few times over.

    Under the interpreter programs run one after another; a small target still exercises
    the split reductions of the backward on tiny test stacks.
    """
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: IEEE fp32 when torch itself would use it, else TF32.

    Follows `torch.get_float32_matmul_precision()`, so the kernels round like the torch path.
    Half-precision inputs carry fewer mantissa bits than TF32, so TF32 loses nothing there.
    """
    if dtype == torch.float32 and _float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


@torch.compiler.assume_constant_result
def _float32_matmul_precision() -> str:
    # Dynamo cannot put the string that torch returns in a graph; traced, it is a constant
    # (and dynamo's guards on global state recompile when the setting changes).
    return torch.get_float32_matmul_precision()
