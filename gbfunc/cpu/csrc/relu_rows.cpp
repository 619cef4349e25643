// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include "block_products.h"
#include "placement.h"
#include <string.h>

static inline float dot(const float* __restrict x, const float* __restrict y) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int p = 0; p < OUTPUTS; ++p) sum += x[p] * y[p];
  return sum;
}

// z[h] = b_in[h] + sum_c col_code[c] w_in[R + c, h] + sum_r code[r] w_in[r, h]
static inline void pre_activations(const float* code, const float* col_code, const float* w_in,
                                   const float* b_in, int64_t row_width, int64_t col_width,
                                   float* z) {
  for (int h = 0; h < HIDDEN; ++h) z[h] = b_in[h];
  for (int64_t c = 0; c < col_width; ++c) {
    const float x = col_code[c];
    const float* w = w_in + (row_width + c) * HIDDEN;
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) z[h] += x * w[h];
  }
  for (int64_t r = 0; r < row_width; ++r) {
    const float x = code[r];
    const float* w = w_in + r * HIDDEN;
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) z[h] += x * w[h];
  }
}

extern "C" void relu_rows_forward(const float* row_code, const float* col_code,
                                  const float* w_in, const float* b_in, const float* w_out,
                                  const float* b_out, const float* scales,
                                  const int64_t* placement, float* const* weights, int64_t tiles,
                                  int64_t tile_rows, int64_t row_width, int64_t col_width, int threads) {
  const int64_t width = row_width + col_width;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t i = 0; i < tile_rows; ++i) {
      const int64_t* at = placement + PLACEMENT * t;
      if (i >= at[ROWS]) continue;
      float z[HIDDEN], acc[OUTPUTS];
      pre_activations(row_code + i * row_width, col_code, w_in + t * width * HIDDEN,
                      b_in + t * HIDDEN, row_width, col_width, z);
      const float* w = w_out + t * HIDDEN * OUTPUTS;
#pragma omp simd
      for (int p = 0; p < OUTPUTS; ++p) acc[p] = b_out[t * OUTPUTS + p];
      for (int h = 0; h < HIDDEN; ++h) {
        const float x = 0.0f > z[h] ? 0.0f : z[h];  // a NaN z kept (as torch.relu): one maxps
        const float* w_h = w + h * OUTPUTS;
#pragma omp simd
        for (int p = 0; p < OUTPUTS; ++p) acc[p] += x * w_h[p];
      }
      const float scale = scales[t];
      float* out = weights[at[WEIGHT]] + at[OFFSET] + i * at[STRIDE];
      const int64_t cols = at[COLS];
#pragma omp simd
      for (int64_t p = 0; p < cols; ++p) out[p] = scale * acc[p];
    }
  }
}

// The backward's two products, each register-blocked (contiguous sums kept in registers across
// the loop that feeds them): phase A, the hidden units' gradients g @ w_out^T (a row of w_out^T
// serves BLOCK rows, sums vectorised over the units: no horizontal sums); phase B, w_out's
// gradient x^T @ g over a CHUNK of rows, per block of UNIT_BLOCK units and OUTPUT_BLOCK outputs.
// 8 or fewer units make one unit block, and phase A pads its units to whole vectors of 8:
// the backward alone with 5 units and 100 outputs took 0.426 ms in blocks of 4 unpadded,
// 0.367 padded, 0.256 in one block (the loop before this one: 0.315).
enum { CHUNK = 32, BLOCK = 8, UNIT_BLOCK = HIDDEN <= 8 ? HIDDEN : 4, OUTPUT_BLOCK = 32 };
enum { PADDED = (HIDDEN + 7) / 8 * 8 };

// Phase A: gh[k][h] = sum_p g[k][p] wt[p][h] for BLOCK rows (wt: w_out transposed, its units
// padded with zeros).
static inline void hidden_gradients(const float* const* g, const float* wt,
                                    float gh[BLOCK][PADDED]) {
  float acc[BLOCK][PADDED];
  for (int k = 0; k < BLOCK; ++k)
    for (int h = 0; h < PADDED; ++h) acc[k][h] = 0.0f;
  add_block_products<BLOCK, OUTPUTS, PADDED>(acc, g, wt);
  for (int k = 0; k < BLOCK; ++k)
    for (int h = 0; h < PADDED; ++h) gh[k][h] = acc[k][h];
}

// Phase B: g_w_out[h][p] += sum_k x[k][h] g[k][p] over `rows` rows, for units h0 .. h0+HB and
// outputs p0 .. p0+W: an (HB, W) block of sums kept in registers across the rows.
template <int HB, int W>
static inline void output_block(const float* const* g, const float (*x)[HIDDEN], int64_t rows,
                                int h0, int p0, float* g_w_out) {
  float acc[HB][W];
  for (int a = 0; a < HB; ++a)
#pragma omp simd
    for (int b = 0; b < W; ++b) acc[a][b] = g_w_out[(h0 + a) * OUTPUTS + p0 + b];
  for (int64_t k = 0; k < rows; ++k) {
    const float* gk = g[k] + p0;
    for (int a = 0; a < HB; ++a) {
      const float xv = x[k][h0 + a];
#pragma omp simd
      for (int b = 0; b < W; ++b) acc[a][b] += xv * gk[b];
    }
  }
  for (int a = 0; a < HB; ++a)
#pragma omp simd
    for (int b = 0; b < W; ++b) g_w_out[(h0 + a) * OUTPUTS + p0 + b] = acc[a][b];
}

template <int HB>
static inline void output_row_of_blocks(const float* const* g, const float (*x)[HIDDEN],
                                        int64_t rows, int h0, float* g_w_out) {
  int p0 = 0;
  for (; p0 + OUTPUT_BLOCK <= OUTPUTS; p0 += OUTPUT_BLOCK)
    output_block<HB, OUTPUT_BLOCK>(g, x, rows, h0, p0, g_w_out);
  if (OUTPUTS % OUTPUT_BLOCK)
    output_block<HB, (OUTPUTS % OUTPUT_BLOCK ? OUTPUTS % OUTPUT_BLOCK : 1)>(g, x, rows, h0,
                                                                            p0, g_w_out);
}

static inline void output_gradients(const float* const* g, const float (*x)[HIDDEN], int64_t rows,
                                    float* g_w_out) {
  int h0 = 0;
  for (; h0 + UNIT_BLOCK <= HIDDEN; h0 += UNIT_BLOCK)
    output_row_of_blocks<UNIT_BLOCK>(g, x, rows, h0, g_w_out);
  if (HIDDEN % UNIT_BLOCK)
    output_row_of_blocks<(HIDDEN % UNIT_BLOCK ? HIDDEN % UNIT_BLOCK : 1)>(g, x, rows, h0,
                                                                          g_w_out);
}

// The leaves' gradients given each weight's gradient (NULL: zero), per row split k of each
// tile: g_w_in (T, splits, R + C, H), g_b_in (T, splits, H), g_w_out (T, splits, H, P),
// g_b_out (T, splits, P).
extern "C" void relu_rows_backward(const float* const* grads, const float* row_code,
                                   const float* col_code, const float* w_in, const float* b_in,
                                   const float* w_out, const float* scales,
                                   const int64_t* placement, float* g_w_in, float* g_b_in,
                                   float* g_w_out, float* g_b_out, int64_t tiles, int64_t tile_rows,
                                   int64_t row_width, int64_t col_width, int64_t splits, int threads) {
  const int64_t width = row_width + col_width;
  static const float zeros[OUTPUTS] = {};
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t job = 0; job < tiles * splits; ++job) {
    const auto [t, at, grad, first, last] = backward_job(job, splits, tile_rows, placement, grads);
    const float* w_in_t = w_in + t * width * HIDDEN;
    const float* w = w_out + t * HIDDEN * OUTPUTS;
    const float scale = scales[t];
    float* g_w_in_job = g_w_in + job * width * HIDDEN;
    float* g_w_out_job = g_w_out + job * HIDDEN * OUTPUTS;
    float* g_b_out_job = g_b_out + job * OUTPUTS;
    float g_z_sum[HIDDEN];
    memset(g_w_in_job, 0, sizeof(float) * width * HIDDEN);
    memset(g_w_out_job, 0, sizeof(float) * HIDDEN * OUTPUTS);
    memset(g_b_out_job, 0, sizeof(float) * OUTPUTS);
    memset(g_z_sum, 0, sizeof(g_z_sum));
    float wt[OUTPUTS][PADDED];
    for (int p = 0; p < OUTPUTS; ++p)
      for (int h = 0; h < PADDED; ++h) wt[p][h] = h < HIDDEN ? w[h * OUTPUTS + p] : 0.0f;
    float padded[CHUNK][OUTPUTS];  // rows of a tile cut at the weight's last column, zero-filled
    const int64_t cols = at[COLS];
    const bool ragged = cols < OUTPUTS;
    for (int64_t i0 = first; i0 < last; i0 += CHUNK) {
      const int64_t rows = last - i0 < CHUNK ? last - i0 : CHUNK;
      const float* g[CHUNK];
      float x[CHUNK][HIDDEN];
      for (int64_t k = 0; k < CHUNK; ++k) {
        if (k >= rows) {
          g[k] = zeros;
          continue;
        }
        const float* row = grad + at[OFFSET] + (i0 + k) * at[STRIDE];
        if (ragged) {
          memcpy(padded[k], row, sizeof(float) * cols);
          memset(padded[k] + cols, 0, sizeof(float) * (OUTPUTS - cols));
          row = padded[k];
        }
        g[k] = row;
      }
      for (int64_t k0 = 0; k0 < rows; k0 += BLOCK) {
        float gh[BLOCK][PADDED];
        hidden_gradients(g + k0, &wt[0][0], gh);
        for (int64_t k = k0; k < k0 + BLOCK && k < rows; ++k) {
          const float* code = row_code + (i0 + k) * row_width;
          float z[HIDDEN], g_z[HIDDEN];
          pre_activations(code, col_code, w_in_t, b_in + t * HIDDEN, row_width, col_width, z);
#pragma omp simd
          for (int h = 0; h < HIDDEN; ++h) {
            g_z[h] = z[h] > 0.0f ? scale * gh[k - k0][h] : 0.0f;
            x[k][h] = 0.0f > z[h] ? 0.0f : z[h];
            g_z_sum[h] += g_z[h];
          }
          for (int64_t r = 0; r < row_width; ++r) {
            const float c = code[r];
            float* g_w = g_w_in_job + r * HIDDEN;
#pragma omp simd
            for (int h = 0; h < HIDDEN; ++h) g_w[h] += c * g_z[h];
          }
        }
      }
      output_gradients(g, x, rows, g_w_out_job);
      for (int64_t k = 0; k < rows; ++k) {
        const float* gk = g[k];
#pragma omp simd
        for (int p = 0; p < OUTPUTS; ++p) g_b_out_job[p] += gk[p];
      }
    }
    for (int64_t c = 0; c < col_width; ++c) {
      float* g_w = g_w_in_job + (row_width + c) * HIDDEN;
#pragma omp simd
      for (int h = 0; h < HIDDEN; ++h) g_w[h] = col_code[c] * g_z_sum[h];
    }
    memcpy(g_b_in + job * HIDDEN, g_z_sum, sizeof(g_z_sum));
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) g_b_out_job[p] *= scale;
    for (int64_t e = 0; e < HIDDEN * OUTPUTS; ++e) g_w_out_job[e] *= scale;
  }
}
