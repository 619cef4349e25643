"""The backward of one-layer, one-output ReLU g-nets in one pass over the gradient, on CPU.

For each tile, `_tilemlp._fused_reductions` needs the output gradient `g` `(TH, Q)` summed
where each hidden unit is active (`b[q, h] > threshold[i, h]`, `threshold = -(a + c)`): over
the columns, `rows` `(TH, H)`, and over the rows, `cols` `(Q, H)`. Written for inductor these
are two reductions along different axes: two passes over the positions, each a compare, a
select and an add per position and unit. This C loop makes one: per row it keeps the row's
sums in registers, vectorised over the units, and adds the same selected gradient into the
columns' sums, which stay in L1. Compiled backward alone, 135 (57, 96) tiles of 32 units,
2 threads (AVX-512): 1.78 -> 0.66 ms.

The source compiles once per number of units (the vector axis, a compile-time constant) with
the C++ compiler and vector ISA flags that inductor uses, into a cache in the temp directory.
It runs as the custom op `gbfunc::relu_unit_sums`, opaque to inductor, with fake, vmap and
autograd rules. `usable` says where: CPU float32, 4 units or more (fewer are faster as
inductor's reductions along the positions). Where the compile fails (no compiler),
inductor's reductions run instead.
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile

import torch
from torch import Tensor

_SOURCE = r"""
#include <string.h>

// rows (T, TH, H) and cols (T, splits, Q, H): for every tile t and row i,
//   rows[t, i, h] = sum_q [b[t, q, h] > threshold[t, i, h]] g[t, i, q]
//   cols[t, k, q, h] = the same selected g summed over the rows of split k.
extern "C" void relu_unit_sums(const float* g, const float* threshold, const float* b,
                               float* rows, float* cols, long tiles, long tile_rows,
                               long columns, long splits, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long job = 0; job < tiles * splits; ++job) {
    const long t = job / splits, split = job % splits;
    const long first = split * tile_rows / splits, last = (split + 1) * tile_rows / splits;
    const float* b_t = b + t * columns * HIDDEN;
    float* col_sums = cols + job * columns * HIDDEN;
    memset(col_sums, 0, sizeof(float) * columns * HIDDEN);
    for (long i = first; i < last; ++i) {
      const float* g_row = g + (t * tile_rows + i) * columns;
      const float* threshold_row = threshold + (t * tile_rows + i) * HIDDEN;
      float bound[HIDDEN], sums[HIDDEN];
      for (int h = 0; h < HIDDEN; ++h) {
        bound[h] = threshold_row[h];
        sums[h] = 0.0f;
      }
      for (long q = 0; q < columns; ++q) {
        const float g_q = g_row[q];
        const float* b_q = b_t + q * HIDDEN;
        float* col_q = col_sums + q * HIDDEN;
#pragma omp simd
        for (int h = 0; h < HIDDEN; ++h) {
          const float selected = b_q[h] > bound[h] ? g_q : 0.0f;
          sums[h] += selected;
          col_q[h] += selected;
        }
      }
      memcpy(rows + (t * tile_rows + i) * HIDDEN, sums, sizeof(float) * HIDDEN);
    }
  }
}
"""

# Units per compiled loop. Fewer than 4 do not fill the narrowest vector (SSE's 4 floats):
# inductor's reductions along the positions are faster there (44 (128, 128) tiles, 2
# threads, AVX-512: 3 units 0.80 ms in C against 0.44; 4 units 0.71 against 0.81). At most
# 512: the per-row sums live on the stack, in registers.
MIN_UNITS = 4
MAX_UNITS = 512

_LIBRARIES: dict[int, ctypes.CDLL | None] = {}


def reference(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`(rows, cols)` as the C loop computes them, in plain torch: the specification.

    Shapes: g `(T, TH, Q)`, threshold `(T, TH, H)`, b `(T, Q, H)`; rows `(T, TH, H)`, cols
    `(T, Q, H)`. A unit is active where `b > threshold` (a tie is not active).
    """
    selected = torch.where(b[:, None] > threshold[:, :, None], g[..., None], 0.0)
    return selected.sum(2), selected.sum(1)


@torch.compiler.assume_constant_result
def usable(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_unit_sums` runs the C loop for `units` hidden units: CPU float32 with a
    vector ISA inductor knows, `MIN_UNITS` to `MAX_UNITS` units, and the loop compiled for
    that many (`benchmarks/bench_unit_split.py`)."""
    if device_type != "cpu" or dtype != torch.float32:
        return False
    if not MIN_UNITS <= units <= MAX_UNITS:
        return False
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return bool(pick_vec_isa()) and _library(units) is not None


@torch.library.custom_op("gbfunc::relu_unit_sums", mutates_args=(), device_types="cpu")
def relu_unit_sums(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`reference(g, threshold, b)` by the C loop (float32 on CPU; `usable` must hold)."""
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    g, threshold, b = g.contiguous(), threshold.contiguous(), b.contiguous()
    threads = torch.get_num_threads()
    # Tiles are shared out among the threads; too few of them and each is split by rows,
    # every split with its own column sums, added after.
    splits = max(1, min(tile_rows, -(-threads // tiles)))
    rows = g.new_empty(tiles, tile_rows, units)
    cols = g.new_empty(tiles, splits, columns, units)
    _library(units).relu_unit_sums(
        g.data_ptr(),
        threshold.data_ptr(),
        b.data_ptr(),
        rows.data_ptr(),
        cols.data_ptr(),
        tiles,
        tile_rows,
        columns,
        splits,
        threads,
    )
    return rows, cols[:, 0] if splits == 1 else cols.sum(1)


@relu_unit_sums.register_fake
def _(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    return g.new_empty(tiles, tile_rows, units), g.new_empty(tiles, columns, units)


@relu_unit_sums.register_vmap
def _(info, in_dims: tuple, g: Tensor, threshold: Tensor, b: Tensor) -> tuple:
    """Genomes batched by `vmap` are more tiles: folded into the tile axis and back."""
    size = info.batch_size
    flat = [
        (x.movedim(d, 0) if d is not None else x.expand(size, *x.shape)).flatten(0, 1)
        for x, d in zip((g, threshold, b), in_dims, strict=True)
    ]
    rows, cols = relu_unit_sums(*flat)
    return (rows.unflatten(0, (size, -1)), cols.unflatten(0, (size, -1))), (0, 0)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    _, threshold, b = inputs
    ctx.save_for_backward(threshold, b)


def _backward(ctx, grad_rows: Tensor, grad_cols: Tensor) -> tuple:
    """Linear in `g`, piecewise constant in the rest (for double backward, which is rare: it
    materialises the `(T, TH, Q, H)` mask)."""
    threshold, b = ctx.saved_tensors
    active = b[:, None] > threshold[:, :, None]
    together = grad_rows[:, :, None, :] + grad_cols[:, None, :, :]
    return torch.where(active, together, 0.0).sum(-1), None, None


relu_unit_sums.register_autograd(_backward, setup_context=_setup_context)


def _library(units: int) -> ctypes.CDLL | None:
    """The C loop compiled for `units` units, loaded (None where it cannot be compiled)."""
    if units not in _LIBRARIES:
        try:
            _LIBRARIES[units] = _load(units)
        except (OSError, subprocess.SubprocessError):
            _LIBRARIES[units] = None
    return _LIBRARIES[units]


def _load(units: int) -> ctypes.CDLL:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    compiler = os.environ.get("CXX", "g++")
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]
    flags += [*pick_vec_isa().build_arch_flags().split(), f"-DHIDDEN={units}"]
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags]).encode()).hexdigest()[:20]
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    folder = os.path.join(tempfile.gettempdir(), f"gbfunc_{user}")
    path = os.path.join(folder, f"relu_unit_sums_{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        source = os.path.join(folder, f"relu_unit_sums_{key}_{os.getpid()}.cpp")
        partial = f"{path}.{os.getpid()}"
        with open(source, "w") as file:
            file.write(_SOURCE)
        try:
            subprocess.run(
                [compiler, *flags, source, "-o", partial],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(partial, path)  # atomic: a concurrent process loads one whole file
        finally:
            for leftover in (source, partial):
                if os.path.exists(leftover):
                    os.remove(leftover)
    library = ctypes.CDLL(path)
    library.relu_unit_sums.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_int]
    library.relu_unit_sums.restype = None
    return library
