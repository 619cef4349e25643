"""Loops in C for one-layer ReLU g-nets on CPU, where inductor's code does redundant work.

- `relu_unit_sums`, for the backward of one-output g-nets: for each tile,
  `_tilemlp._fused_reductions` needs the output gradient `g` `(TH, Q)` summed where each
  hidden unit is active (`b[q, h] > threshold[i, h]`, `threshold = -(a + c)`): over the
  columns, `rows` `(TH, H)`, and over the rows, `cols` `(Q, H)`. Written for inductor these
  are two reductions along different axes: two passes over the positions, each a compare, a
  select and an add per position and unit. The loop makes one: per row it keeps the row's
  sums in registers, vectorised over the units, and adds the same selected gradient into the
  columns' sums, which stay in L1. Backward alone, 135 (57, 96) tiles of 32 units, 2
  threads (AVX-512): 1.73 -> 0.90 ms (`benchmarks/bench_unit_split.py`). Four rows at a
  time share each load of `b` and each update of the columns' sums: the loop alone on 44
  (128, 128) tiles of 32 units 0.65 -> 0.57 ms, on a (512, 784) tile of 4 units 0.17 ->
  0.10 ms.
- `relu_one_output`, for the forward of one-output g-nets (`_tilemlp._one_output_in_c`):
  inductor's sum over the units, vectorised over the columns, reloads each unit's column
  terms for every row; the loop holds four rows' sums in registers, so one load serves the
  four. Forward alone, 135 (57, 96) tiles of 32 units, 2 threads (AVX-512): 0.73 -> 0.47 ms.
- `relu_layer_forward`, for the forward of g-nets with a few outputs (`_tilemlp._unrolls`):
  inductor's unrolled sum recomputes every hidden activation once per output; the loop
  computes a position's activations once, vectorised over the units, then its outputs as a
  sum of rows of `w_out`, vectorised over the outputs, eight positions at a time (then
  four, then one; eight independent chains of multiply-adds). Forward alone, 44 (128, 128)
  tiles of 32 units and 16 outputs, 2 threads (AVX-512): 4.79 -> 0.32 ms; eight positions
  rather than four, with the outputs' copies vectorised (Intel Xeon): 0.230 -> 0.205 ms
  there, 168 (64, 64) tiles of 8 units and 8 outputs 0.301 -> 0.162 ms, and the MLP's step
  with 8 units and 8 outputs 1.504x -> 1.440x the plain step compiled, 1.680x -> 1.622x
  eagerly (`outputs=16` compiled 1.576x -> 1.537x).
- `relu_layer_backward`, its backward: inductor's (from `_tilemlp._backward_units_major`)
  is two matmuls with 16 or fewer outputs as their short axis, where MKL is slow, and
  reductions around them; the loop recomputes a position's activations, their gradient, and
  adds into every sum (over the columns, the rows, the positions) in one pass. The same
  tiles: 1.69 -> 0.93 ms; 176 (64, 64) tiles of 8 units and 8 outputs: 1.42 -> 0.35 ms.
  Four positions at a time share each pass over `w_out`'s gradient and each row of
  `w_out` (Intel Xeon, AVX-512, 2 threads): 44 (128, 128) tiles of 32 units and 16 outputs
  0.83 -> 0.55 ms, 168 (64, 64) tiles of 8 units and 8 outputs 0.35 -> 0.24 ms; the MLP's
  training step, one process, interleaved rounds, x the plain step, with `outputs=16`
  compiled 1.690 -> 1.511, eager 2.378 -> 2.188, with 8 units and 8 outputs compiled 1.545
  -> 1.484, eager 1.703 -> 1.658. Units that do not fill 4-lane vectors go one position at
  a time: 6 and 7 units still ran 8% and 22% slower than before (scratch A/B).

Each source compiles once per shape constant (units, outputs) with the C++ compiler and
vector ISA flags that inductor uses, into a cache in the temp directory, and runs as a custom
op (`gbfunc::...`), opaque to inductor, with fake, vmap and autograd rules (the latter by
autograd through the torch specification). `sums_usable`, `one_output_usable` and
`layer_usable` say where: CPU float32 and enough units; elsewhere, or where the compile
fails (no compiler), inductor's code runs instead.
"""

import ctypes
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

# The backward's masked sums of one-output g-nets, shared by `relu_unit_sums` and
# `_relu_tiles`.
UNIT_SUMS_BLOCK_SOURCE = r"""
// Rows r < R of a tile (g's rows `stride` apart; bound[r] their thresholds, -(a + c)): each
// row's sums of g over the columns q < cols where a unit is active (b[q, h] > bound[r][h]),
// into sums[r], and the same selected g added into col_sums (cols, H); g's total added into
// *total. R rows at a time read b and update col_sums once for all R: fewer loads and stores
// per position.
#if defined(__AVX512F__) && HIDDEN % 16 == 0
#include <immintrin.h>
// With AVX-512, a compare into a mask and two masked adds per row and 16 units: GCC writes the
// portable loop below as a compare, a masked broadcast and two adds, and the compares and
// broadcasts all wait for the one port that runs both. 16 units at a time, so that the rows'
// sums and thresholds stay in registers.
template <int R>
static inline void unit_sums_block(const float* g, long stride, const float (*bound)[HIDDEN],
                                   const float* b, float (*sums)[HIDDEN], float* col_sums,
                                   long cols, float* total) {
  for (int v = 0; v < HIDDEN; v += 16) {
    __m512 sum[R], threshold[R];
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm512_setzero_ps();
      threshold[r] = _mm512_loadu_ps(bound[r] + v);
    }
    for (long q = 0; q < cols; ++q) {
      const __m512 b_q = _mm512_loadu_ps(b + q * HIDDEN + v);
      float* col_q = col_sums + q * HIDDEN + v;
      __m512 col = _mm512_loadu_ps(col_q);
      for (int r = 0; r < R; ++r) {
        const __m512 g_q = _mm512_set1_ps(g[r * stride + q]);
        const __mmask16 active = _mm512_cmp_ps_mask(b_q, threshold[r], _CMP_GT_OQ);
        sum[r] = _mm512_mask_add_ps(sum[r], active, sum[r], g_q);
        col = _mm512_mask_add_ps(col, active, col, g_q);
      }
      _mm512_storeu_ps(col_q, col);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[r] + v, sum[r]);
  }
  for (int r = 0; r < R; ++r) {
    float row_total = 0.0f;
#pragma omp simd reduction(+ : row_total)
    for (long q = 0; q < cols; ++q) row_total += g[r * stride + q];
    *total += row_total;
  }
}
#else
// The column's sum is loaded first and added to in turn: adding the rows' total to it at the
// end made GCC's code for units that do not fill whole vectors 1.4-5x slower (44 (128, 128)
// tiles, 5-28 units). Each row keeps its own total: one total for all took R dependent adds
// per column.
template <int R>
static inline void unit_sums_block(const float* g, long stride, const float (*bound)[HIDDEN],
                                   const float* b, float (*sums)[HIDDEN], float* col_sums,
                                   long cols, float* total) {
  float row_totals[R];
  for (int r = 0; r < R; ++r) {
    row_totals[r] = 0.0f;
    for (int h = 0; h < HIDDEN; ++h) sums[r][h] = 0.0f;
  }
  for (long q = 0; q < cols; ++q) {
    float g_q[R];
    for (int r = 0; r < R; ++r) {
      g_q[r] = g[r * stride + q];
      row_totals[r] += g_q[r];
    }
    const float* b_q = b + q * HIDDEN;
    float* col_q = col_sums + q * HIDDEN;
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) {
      const float b_h = b_q[h];
      float col = col_q[h];
      for (int r = 0; r < R; ++r) {
        const float selected = b_h > bound[r][h] ? g_q[r] : 0.0f;
        sums[r][h] += selected;
        col += selected;
      }
      col_q[h] = col;
    }
  }
  for (int r = 0; r < R; ++r) *total += row_totals[r];
}
#endif
"""

_SUMS_SOURCE = (
    UNIT_SUMS_BLOCK_SOURCE
    + r"""
#include <string.h>

// Rows i .. i + R - 1 of a tile (g, threshold and rows from row i), by `unit_sums_block`.
template <int R>
static inline void row_block(const float* g, const float* threshold, const float* b,
                             float* rows, float* col_sums, long columns) {
  float bound[R][HIDDEN], sums[R][HIDDEN], total = 0.0f;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HIDDEN; ++h) bound[r][h] = threshold[r * HIDDEN + h];
  unit_sums_block<R>(g, columns, bound, b, sums, col_sums, columns, &total);
  memcpy(rows, sums, sizeof(float) * R * HIDDEN);
}

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
    long i = first;
    for (; i + 4 <= last; i += 4) {
      const long row = t * tile_rows + i;
      row_block<4>(g + row * columns, threshold + row * HIDDEN, b_t, rows + row * HIDDEN,
                   col_sums, columns);
    }
    for (; i < last; ++i) {
      const long row = t * tile_rows + i;
      row_block<1>(g + row * columns, threshold + row * HIDDEN, b_t, rows + row * HIDDEN,
                   col_sums, columns);
    }
  }
}
"""
)

_FORWARD_SOURCE = r"""
// out (T, TH, Q, P): out[t, i, q] = b_out[t] + sum_h relu(row[t, i, h] + b[t, q, h]) w_out[t, h].
template <int BLOCK>
static inline void positions(const float* row, const float* b, const float* w,
                             const float* bias, float* out) {
  float hidden[BLOCK][HIDDEN], acc[BLOCK][OUTPUTS];
  for (int k = 0; k < BLOCK; ++k) {
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) {
      const float z = row[h] + b[k * HIDDEN + h];
      hidden[k][h] = z > 0.0f ? z : 0.0f;
    }
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) acc[k][p] = bias[p];
  }
  for (int h = 0; h < HIDDEN; ++h) {
    const float* w_h = w + h * OUTPUTS;
    for (int k = 0; k < BLOCK; ++k) {
      const float x = hidden[k][h];
#pragma omp simd
      for (int p = 0; p < OUTPUTS; ++p) acc[k][p] += x * w_h[p];
    }
  }
  for (int k = 0; k < BLOCK; ++k)
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) out[k * OUTPUTS + p] = acc[k][p];
}

extern "C" void relu_layer_forward(const float* row_terms, const float* b, const float* w_out,
                                   const float* b_out, float* out, long tiles, long tile_rows,
                                   long columns, int threads) {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (long t = 0; t < tiles; ++t) {
    for (long i = 0; i < tile_rows; ++i) {
      const float* row = row_terms + (t * tile_rows + i) * HIDDEN;
      const float* b_t = b + t * columns * HIDDEN;
      const float* w = w_out + t * HIDDEN * OUTPUTS;
      const float* bias = b_out + t * OUTPUTS;
      float* o = out + (t * tile_rows + i) * columns * OUTPUTS;
      long q = 0;
      for (; q + 8 <= columns; q += 8)
        positions<8>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
      for (; q + 4 <= columns; q += 4)
        positions<4>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
      for (; q < columns; ++q) positions<1>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
    }
  }
}
"""

_BACKWARD_SOURCE = r"""
#include <string.h>

// Positions per block: 4 where the units fill whole 4-lane vectors; others one at a time (7
// units ran 22% slower in blocks).
enum { BLOCK = HIDDEN % 4 == 0 ? 4 : 1 };

// Positions q .. q + K - 1 of row i (grad g (K, P), column terms b_q (K, H), their column sums
// col (K, H)): their hidden units' gradients (each row of w_t serving the K positions), the
// row's and the columns' sums, and w_out's gradient, each pass over g_w serving K positions.
template <int K>
static inline void positions(const float* __restrict g, const float* __restrict row,
                             const float* __restrict b_q, const float (*__restrict w_t)[HIDDEN],
                             float* __restrict rows, float* __restrict col,
                             float* __restrict g_w) {
  float z[K][HIDDEN], g_hidden[K][HIDDEN], x[K][HIDDEN];
  for (int k = 0; k < K; ++k)
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) {
      z[k][h] = row[h] + b_q[k * HIDDEN + h];
      g_hidden[k][h] = 0.0f;
    }
  for (int p = 0; p < OUTPUTS; ++p)
    for (int k = 0; k < K; ++k) {
      const float g_p = g[k * OUTPUTS + p];
#pragma omp simd
      for (int h = 0; h < HIDDEN; ++h) g_hidden[k][h] += g_p * w_t[p][h];
    }
  for (int k = 0; k < K; ++k)
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) {
      const float g_z = z[k][h] > 0.0f ? g_hidden[k][h] : 0.0f;
      rows[h] += g_z;
      col[k * HIDDEN + h] += g_z;
      x[k][h] = z[k][h] > 0.0f ? z[k][h] : 0.0f;
    }
  for (int h = 0; h < HIDDEN; ++h) {
    float* g_w_h = g_w + h * OUTPUTS;
    float x_h[K];
    for (int k = 0; k < K; ++k) x_h[k] = x[k][h];
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) {
      float sum = g_w_h[p];
      for (int k = 0; k < K; ++k) sum += x_h[k] * g[k * OUTPUTS + p];
      g_w_h[p] = sum;
    }
  }
}

// The gradients of relu_layer_forward given grad (T, TH, Q, P), for the rows of split k:
//   g_rows (T, TH, H), g_cols (T, splits, Q, H), g_w (T, splits, H, P).
extern "C" void relu_layer_backward(const float* grad, const float* row_terms, const float* b,
                                    const float* w_out, float* g_rows, float* g_cols,
                                    float* g_w, long tiles, long tile_rows, long columns,
                                    long splits, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long job = 0; job < tiles * splits; ++job) {
    const long t = job / splits, split = job % splits;
    const long first = split * tile_rows / splits, last = (split + 1) * tile_rows / splits;
    const float* w = w_out + t * HIDDEN * OUTPUTS;
    float w_t[OUTPUTS][HIDDEN];
    for (int h = 0; h < HIDDEN; ++h)
      for (int p = 0; p < OUTPUTS; ++p) w_t[p][h] = w[h * OUTPUTS + p];
    float* cols = g_cols + job * columns * HIDDEN;
    float* g_w_job = g_w + job * HIDDEN * OUTPUTS;
    memset(cols, 0, sizeof(float) * columns * HIDDEN);
    memset(g_w_job, 0, sizeof(float) * HIDDEN * OUTPUTS);
    const float* b_t = b + t * columns * HIDDEN;
    for (long i = first; i < last; ++i) {
      const float* row = row_terms + (t * tile_rows + i) * HIDDEN;
      const float* g = grad + (t * tile_rows + i) * columns * OUTPUTS;
      float rows[HIDDEN];
      for (int h = 0; h < HIDDEN; ++h) rows[h] = 0.0f;
      long q = 0;
      for (; q + BLOCK <= columns; q += BLOCK)
        positions<BLOCK>(g + q * OUTPUTS, row, b_t + q * HIDDEN, w_t, rows, cols + q * HIDDEN,
                     g_w_job);
      for (; q < columns; ++q)
        positions<1>(g + q * OUTPUTS, row, b_t + q * HIDDEN, w_t, rows, cols + q * HIDDEN,
                     g_w_job);
      memcpy(g_rows + (t * tile_rows + i) * HIDDEN, rows, sizeof(float) * HIDDEN);
    }
  }
}
"""

# C shared by the loops that write tiles where they land and read gradients in place
# (`_relu_rows`, `_relu_tiles`, `_hash_weights`): the placement's layout and what each of
# their backward jobs reads.
PLACEMENT_SOURCE = r"""
// A tile's placement: [weight, offset of its first element, the weight's row stride,
// rows, columns] (rows and columns inside the weight: fewer than the tile's at a ragged edge).
enum { WEIGHT, OFFSET, STRIDE, ROWS, COLS, PLACEMENT };

// A backward job: row split `job % splits` of tile `job / splits` (of `tile_rows` rows),
// its placement `at`, its weight's gradient `grad` (NULL: zero) and the rows [first, last)
// it reads: cut at the weight's last row, none where `grad` is NULL.
struct BackwardJob {
  long tile;
  const long* at;
  const float* grad;
  long first, last;
};

static inline BackwardJob backward_job(long job, long splits, long tile_rows,
                                       const long* placement, const float* const* grads) {
  const long tile = job / splits, split = job % splits;
  const long* at = placement + PLACEMENT * tile;
  const float* grad = grads[at[WEIGHT]];
  const long first = split * tile_rows / splits, stop = (split + 1) * tile_rows / splits;
  const long last = grad == 0 ? first : (stop < at[ROWS] ? stop : at[ROWS]);
  return {tile, at, grad, first, last};
}
"""

# The one-output forward's block, shared by `relu_one_output` and `_relu_tiles`.
ONE_OUTPUT_BLOCK_SOURCE = r"""
enum { BLOCK_ROWS = 4, COLUMN_BLOCK = 32 };

// Rows k < n (n <= BLOCK_ROWS) of a block, columns j < W: dst[k * stride + j] = scale
// (row_bias[k] + sum_h w[h] max(b_t[h][j], floor[k][h])), b_t's rows `columns` apart. With
// floor = -a and row_bias[k] = bias + sum_h w[h] a[k][h] that is scale (bias + sum_h w[h]
// relu(a[k][h] + b_t[h][j])), as relu(a + b) = max(b, -a) + a: a max and a multiply-add per
// unit and position, where relu(a + b) w takes an add, a max and a multiply-add (and GCC
// writes `z > 0 ? z : 0` as a compare and a masked move). The BLOCK_ROWS x W sums stay in
// registers, one load of each unit's column terms serving every row; they start at row_bias,
// not at zero (which GCC makes a memset).
template <int W>
static inline void block(const float* floor, const float* row_bias, long n, const float* b_t,
                         long columns, const float* w, float scale, float* dst, long stride) {
  float acc[BLOCK_ROWS][W];
  for (int k = 0; k < BLOCK_ROWS; ++k)
#pragma omp simd
    for (int j = 0; j < W; ++j) acc[k][j] = row_bias[k];
  for (int h = 0; h < HIDDEN; ++h) {
    const float w_h = w[h];
    const float* col = b_t + h * columns;
    for (int k = 0; k < BLOCK_ROWS; ++k) {
      const float f = floor[k * HIDDEN + h];
#pragma omp simd
      for (int j = 0; j < W; ++j) {
        const float c = col[j];
        acc[k][j] += (c > f ? c : f) * w_h;
      }
    }
  }
  for (long k = 0; k < n; ++k)
#pragma omp simd
    for (int j = 0; j < W; ++j) dst[k * stride + j] = scale * acc[k][j];
}
"""

_ONE_OUTPUT_SOURCE = (
    ONE_OUTPUT_BLOCK_SOURCE
    + r"""
// out (T, TH, Q) from row_terms (T, TH, H), b_t (T, H, Q) and w (T, H).
extern "C" void relu_one_output(const float* row_terms, const float* b_t, const float* w,
                                float* out, long tiles, long tile_rows, long columns,
                                int threads) {
  const long blocks = (tile_rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (long t = 0; t < tiles; ++t) {
    for (long row_block = 0; row_block < blocks; ++row_block) {
      const long i = row_block * BLOCK_ROWS;
      const long n = tile_rows - i < BLOCK_ROWS ? tile_rows - i : BLOCK_ROWS;
      const float* rows = row_terms + (t * tile_rows + i) * HIDDEN;
      const float* b = b_t + t * HIDDEN * columns;
      const float* w_t = w + t * HIDDEN;
      float floor[BLOCK_ROWS * HIDDEN], row_bias[BLOCK_ROWS];  // rows past the tile's last:
      for (int k = 0; k < BLOCK_ROWS; ++k) {                   // zeros, computed and dropped
        float s = 0.0f;
        for (int h = 0; h < HIDDEN; ++h) {
          const float a = k < n ? rows[k * HIDDEN + h] : 0.0f;
          floor[k * HIDDEN + h] = -a;
          s += w_t[h] * a;
        }
        row_bias[k] = s;
      }
      float* o = out + (t * tile_rows + i) * columns;
      long q = 0;
      for (; q + COLUMN_BLOCK <= columns; q += COLUMN_BLOCK)
        block<COLUMN_BLOCK>(floor, row_bias, n, b + q, columns, w_t, 1.0f, o + q, columns);
      for (; q < columns; ++q)
        block<1>(floor, row_bias, n, b + q, columns, w_t, 1.0f, o + q, columns);
    }
  }
}
"""
)

# Units per compiled loop. Fewer than 4 do not fill the narrowest vector (SSE's 4 floats):
# inductor's reductions along the positions are faster there (the backward's sums on 44
# (128, 128) tiles, 2 threads, AVX-512: 3 units 0.80 ms in C against 0.44, scratch; 4 units
# 0.46 against 0.61, `bench_unit_split.md`). At most 512: a position's or a row's values
# live on the stack, in registers.
MIN_UNITS = 4
MAX_UNITS = 512


class Loop(NamedTuple):
    """A C function: its name, source, and how many tensor pointers and sizes it takes (then
    the thread count)."""

    name: str
    source: str
    pointers: int
    sizes: int


_SUMS = Loop("relu_unit_sums", _SUMS_SOURCE, pointers=5, sizes=4)
_FORWARD = Loop("relu_layer_forward", _FORWARD_SOURCE, pointers=5, sizes=3)
_BACKWARD = Loop("relu_layer_backward", _BACKWARD_SOURCE, pointers=7, sizes=4)
_ONE_OUTPUT = Loop("relu_one_output", _ONE_OUTPUT_SOURCE, pointers=4, sizes=3)
_LIBRARIES: dict[tuple, ctypes.CDLL | None] = {}


def _differentiated_as(op: torch.library.CustomOpDef, reference: Callable) -> None:
    """Give the custom op `op` the gradients of its specification `reference`, by autograd
    through it (for double backward and transforms that differentiate the op itself, which
    are rare: the reference materialises what the loop avoids)."""

    def setup_context(ctx, inputs: tuple, output) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        given = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if grad is not None]
        if not given:
            return (None,) * len(inputs)
        outputs, grads = zip(*given, strict=True)
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)

    op.register_autograd(backward, setup_context=setup_context)


def sums_reference(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`(rows, cols)` as `relu_unit_sums` computes them, in plain torch: the specification.

    Shapes: g `(T, TH, Q)`, threshold `(T, TH, H)`, b `(T, Q, H)`; rows `(T, TH, H)`, cols
    `(T, Q, H)`. A unit is active where `b > threshold` (a tie is not active).
    """
    selected = torch.where(b[:, None] > threshold[:, :, None], g[..., None], 0.0)
    return selected.sum(2), selected.sum(1)


def forward_reference(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    """`relu_layer_forward` in plain torch: the specification.

    Shapes: row_terms `(T, TH, H)` (`a + c`), b `(T, Q, H)`, w_out `(T, H, P)`, b_out
    `(T, P)`; returns `(T, TH, Q, P)`.
    """
    hidden = torch.relu(row_terms[:, :, None, :] + b[:, None, :, :])
    return torch.einsum("tiqh,thp->tiqp", hidden, w_out) + b_out[:, None, None, :]


def one_output_reference(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    """`relu_one_output` in plain torch: the specification.

    Shapes: row_terms `(T, TH, H)` (`a + c`), b_t `(T, H, Q)` (column terms, units-major),
    w `(T, H)`; returns `(T, TH, Q)`, without the output bias.
    """
    hidden = torch.relu(row_terms[:, :, :, None] + b_t[:, None, :, :])  # (T, TH, H, Q)
    return (hidden * w[:, None, :, None]).sum(2)


def backward_reference(
    grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`relu_layer_backward` in plain torch: the gradients of `forward_reference` w.r.t.
    `row_terms`, `b` and `w_out`, given `grad` `(T, TH, Q, P)` (that of `b_out` is
    `grad.sum((1, 2))`)."""
    z = row_terms[:, :, None, :] + b[:, None, :, :]  # (T, TH, Q, H)
    g_z = torch.einsum("tiqp,thp->tiqh", grad, w_out) * (z > 0)
    g_w_out = torch.einsum("tiqh,tiqp->thp", torch.relu(z), grad)
    return g_z.sum(2), g_z.sum(1), g_w_out


@torch.compiler.assume_constant_result
def sums_usable(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_unit_sums` runs its C loop for `units` hidden units: CPU float32 with a
    vector ISA inductor knows, `MIN_UNITS` to `MAX_UNITS` units, and the loop compiled."""
    if not supported(units, dtype, device_type):
        return False
    return compiled_loop(_SUMS, units) is not None


@torch.compiler.assume_constant_result
def layer_usable(units: int, outputs: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_layer_forward` and `relu_layer_backward` run their C loops for a layer
    of `units` units and `outputs` outputs: as `sums_usable`, for 1 to 64 outputs."""
    if not supported(units, dtype, device_type) or not 1 <= outputs <= 64:
        return False
    return all(compiled_loop(loop, units, outputs) is not None for loop in (_FORWARD, _BACKWARD))


@torch.compiler.assume_constant_result
def one_output_usable(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_one_output` runs its C loop for `units` hidden units: as `sums_usable`."""
    return supported(units, dtype, device_type) and compiled_loop(_ONE_OUTPUT, units) is not None


@torch.library.custom_op("gbfunc::relu_unit_sums", mutates_args=(), device_types="cpu")
def relu_unit_sums(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`sums_reference(g, threshold, b)` by the C loop (`sums_usable` must hold)."""
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    g, threshold, b = g.contiguous(), threshold.contiguous(), b.contiguous()
    threads, splits = threads_and_splits(tiles, tile_rows)
    rows = g.new_empty(tiles, tile_rows, units)
    cols = g.new_empty(tiles, splits, columns, units)
    _run(
        _SUMS, units, 1, (g, threshold, b, rows, cols), (tiles, tile_rows, columns, splits), threads
    )
    return rows, splits_added(cols)


@relu_unit_sums.register_fake
def _(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    return g.new_empty(tiles, tile_rows, units), g.new_empty(tiles, columns, units)


@relu_unit_sums.register_vmap
def _(info, in_dims: tuple, g: Tensor, threshold: Tensor, b: Tensor) -> tuple:
    rows, cols = relu_unit_sums(*tiles_folded(info.batch_size, in_dims, (g, threshold, b)))
    return (tiles_unfolded(info.batch_size, rows), tiles_unfolded(info.batch_size, cols)), (0, 0)


_differentiated_as(relu_unit_sums, sums_reference)


@torch.library.custom_op("gbfunc::relu_one_output", mutates_args=(), device_types="cpu")
def relu_one_output(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    """`one_output_reference(row_terms, b_t, w)` by the C loop (`one_output_usable` must
    hold), contiguous."""
    tiles, tile_rows, units = row_terms.shape
    columns = b_t.shape[-1]
    row_terms, b_t, w = (x.contiguous() for x in (row_terms, b_t, w))
    out = row_terms.new_empty(tiles, tile_rows, columns)
    sizes = (tiles, tile_rows, columns)
    _run(_ONE_OUTPUT, units, 1, (row_terms, b_t, w, out), sizes, torch.get_num_threads())
    return out


@relu_one_output.register_fake
def _(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    return row_terms.new_empty(*row_terms.shape[:2], b_t.shape[-1])


@relu_one_output.register_vmap
def _(info, in_dims: tuple, row_terms: Tensor, b_t: Tensor, w: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (row_terms, b_t, w))
    return tiles_unfolded(info.batch_size, relu_one_output(*folded)), 0


_differentiated_as(relu_one_output, one_output_reference)


@torch.library.custom_op("gbfunc::relu_layer_forward", mutates_args=(), device_types="cpu")
def relu_layer_forward(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    """`forward_reference(row_terms, b, w_out, b_out)` by the C loop (`layer_usable` must
    hold), contiguous."""
    tiles, tile_rows, units = row_terms.shape
    columns, outputs = b.shape[1], w_out.shape[-1]
    row_terms, b, w_out, b_out = (x.contiguous() for x in (row_terms, b, w_out, b_out))
    out = row_terms.new_empty(tiles, tile_rows, columns, outputs)
    _run(
        _FORWARD,
        units,
        outputs,
        (row_terms, b, w_out, b_out, out),
        (tiles, tile_rows, columns),
        torch.get_num_threads(),
    )
    return out


@relu_layer_forward.register_fake
def _(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    tiles, tile_rows, _ = row_terms.shape
    return row_terms.new_empty(tiles, tile_rows, b.shape[1], w_out.shape[-1])


@relu_layer_forward.register_vmap
def _(info, in_dims: tuple, row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (row_terms, b, w_out, b_out))
    return tiles_unfolded(info.batch_size, relu_layer_forward(*folded)), 0


_differentiated_as(relu_layer_forward, forward_reference)


@torch.library.custom_op("gbfunc::relu_layer_backward", mutates_args=(), device_types="cpu")
def relu_layer_backward(
    grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`backward_reference(grad, row_terms, b, w_out)` by the C loop (`layer_usable` must
    hold): for each position the hidden activations once, their gradient from `w_out`'s
    columns, and every sum (over the columns, the rows, the positions) in one pass."""
    tiles, tile_rows, units = row_terms.shape
    columns, outputs = b.shape[1], w_out.shape[-1]
    grad, row_terms, b, w_out = (x.contiguous() for x in (grad, row_terms, b, w_out))
    threads, splits = threads_and_splits(tiles, tile_rows)
    g_rows = grad.new_empty(tiles, tile_rows, units)
    g_cols = grad.new_empty(tiles, splits, columns, units)
    g_w_out = grad.new_empty(tiles, splits, units, outputs)
    tensors = (grad, row_terms, b, w_out, g_rows, g_cols, g_w_out)
    _run(_BACKWARD, units, outputs, tensors, (tiles, tile_rows, columns, splits), threads)
    return g_rows, splits_added(g_cols), splits_added(g_w_out)


@relu_layer_backward.register_fake
def _(grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor) -> tuple:
    return row_terms.new_empty(row_terms.shape), b.new_empty(b.shape), w_out.new_empty(w_out.shape)


@relu_layer_backward.register_vmap
def _(info, in_dims: tuple, grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (grad, row_terms, b, w_out))
    out = relu_layer_backward(*folded)
    return tuple(tiles_unfolded(info.batch_size, x) for x in out), (0, 0, 0)


_differentiated_as(relu_layer_backward, backward_reference)


def threads_and_splits(tiles: int, tile_rows: int) -> tuple[int, int]:
    """torch's thread count, and into how many row ranges the loops split each tile: tiles
    are shared out among the threads; too few of them and each is split by rows, every split
    with its own partial sums (`splits_added`)."""
    threads = torch.get_num_threads()
    return threads, max(1, min(tile_rows, -(-threads // tiles)))


def splits_added(partials: Tensor) -> Tensor:
    """`(T, splits, ...)` partial sums, one per row split, added: `(T, ...)`."""
    return partials[:, 0] if partials.shape[1] == 1 else partials.sum(1)


def tiles_folded(size: int, in_dims: tuple, args: tuple) -> list[Tensor]:
    """Genomes batched by `vmap` are more tiles: the batch axis folded into the tile axis."""
    return [
        (x.movedim(d, 0) if d is not None else x.expand(size, *x.shape)).flatten(0, 1)
        for x, d in zip(args, in_dims, strict=True)
    ]


def tiles_unfolded(size: int, x: Tensor) -> Tensor:
    """`tiles_folded`'s inverse on a result: `(size * T, ...) -> (size, T, ...)`."""
    return x.unflatten(0, (size, -1))


def supported(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether loops for `units` hidden units can run here: `MIN_UNITS` to `MAX_UNITS` units,
    where `vectorised_cpu` holds."""
    return MIN_UNITS <= units <= MAX_UNITS and vectorised_cpu(dtype, device_type)


def vectorised_cpu(dtype: torch.dtype, device_type: str) -> bool:
    """Whether C loops can run here at all: CPU float32, and a vector ISA inductor knows (its
    compile flags are the loops')."""
    if device_type != "cpu" or dtype != torch.float32:
        return False
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return bool(pick_vec_isa())


def _run(loop: Loop, units: int, outputs: int, tensors: tuple, sizes: tuple, threads: int) -> None:
    """Call `loop` compiled for `units` and `outputs` on contiguous `tensors` (inputs, then the
    outputs it writes), `sizes` and `threads`."""
    compiled_loop(loop, units, outputs)(*(t.data_ptr() for t in tensors), *sizes, threads)


def compiled_loop(loop: Loop, units: int, outputs: int = 1) -> ctypes._CFuncPtr | None:
    """`loop` compiled for `units` units and `outputs` outputs (None where it cannot be)."""
    key = (loop, units, outputs)
    if key not in _LIBRARIES:
        try:
            _LIBRARIES[key] = _load(loop, units, outputs)
        except (OSError, subprocess.SubprocessError):
            _LIBRARIES[key] = None
    library = _LIBRARIES[key]
    return None if library is None else getattr(library, loop.name)


def _load(loop: Loop, units: int, outputs: int) -> ctypes.CDLL:
    """Compile `loop` (cached in the temp directory across processes) and load it."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    compiler = os.environ.get("CXX", "g++")
    flags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]
    flags += pick_vec_isa().build_arch_flags().split()
    flags += [f"-DHIDDEN={units}", f"-DOUTPUTS={outputs}"]
    key = hashlib.sha256("\0".join([loop.source, compiler, *flags]).encode()).hexdigest()[:20]
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    folder = os.path.join(tempfile.gettempdir(), f"gbfunc_{user}")
    path = os.path.join(folder, f"{loop.name}_{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        source = os.path.join(folder, f"{loop.name}_{key}_{os.getpid()}.cpp")
        partial = f"{path}.{os.getpid()}"
        with open(source, "w") as file:
            file.write(loop.source)
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
    function = getattr(library, loop.name)
    function.argtypes = (
        [ctypes.c_void_p] * loop.pointers + [ctypes.c_long] * loop.sizes + [ctypes.c_int]
    )
    function.restype = None
    return library
