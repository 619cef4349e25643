// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include "placement.h"
#include "one_output_block.h"
#include "unit_sums_block.h"
#include <stdlib.h>
#include <string.h>

// z[h] += sum_r code[r] w[r, h]
static inline void add_terms(const float* code, const float* w, int64_t width, float* z) {
  for (int64_t r = 0; r < width; ++r) {
    const float x = code[r];
    const float* w_r = w + r * HIDDEN;
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) z[h] += x * w_r[h];
  }
}

// g_w[r, h] += code[r] g[h] for every r < width
static inline void add_outer(const float* code, const float* g, int64_t width, float* g_w) {
  for (int64_t r = 0; r < width; ++r) {
    const float x = code[r];
    float* g_r = g_w + r * HIDDEN;
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) g_r[h] += x * g[h];
  }
}

enum { TERM_LANES = 16 };

// b_t (H, padded) = (col_code @ w_col)^T, TERM_LANES columns at a time summed in registers
// (code_t: col_code transposed and zero-padded, (C, padded), padded a multiple of
// TERM_LANES): stored to every unit's row once, where adding each code bit's product in
// memory took a quarter of the loop and then a tenth.
static inline void column_terms(const float* code_t, const float* w_col, int64_t padded,
                                int64_t col_width, float* b_t) {
  for (int h = 0; h < HIDDEN; ++h) {
    for (int64_t q = 0; q < padded; q += TERM_LANES) {
      float sums[TERM_LANES];
#pragma omp simd
      for (int j = 0; j < TERM_LANES; ++j) sums[j] = 0.0f;
      for (int64_t c = 0; c < col_width; ++c) {
        const float x = w_col[c * HIDDEN + h];
        const float* code = code_t + c * padded + q;
#pragma omp simd
        for (int j = 0; j < TERM_LANES; ++j) sums[j] += x * code[j];
      }
#pragma omp simd
      for (int j = 0; j < TERM_LANES; ++j) b_t[h * padded + q + j] = sums[j];
    }
  }
}

// Per row split k of each tile (its own column terms, in cache), the split's rows of the
// tile, cut, scaled and written where they land. A row's sum_h w[h] a[i, h], `block`'s
// row_bias, is row_base + row_code[i] . row_dot, with the tile's row_base = b_out + w . b_in
// and row_dot = w_in[:R] @ w: a few products per row where summing across the units is a
// chain of shuffles.
extern "C" void relu_tiles_forward(const float* row_code, const float* col_code,
                                   const float* w_in, const float* b_in, const float* w_out,
                                   const float* b_out, const float* scales,
                                   const int64_t* placement, float* const* weights, int64_t tiles,
                                   int64_t tile_rows, int64_t columns, int64_t row_width, int64_t col_width,
                                   int64_t splits, int threads) {
  const int64_t width = row_width + col_width;
  const int64_t blocks = (tile_rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
  const int64_t padded = (columns + TERM_LANES - 1) / TERM_LANES * TERM_LANES;
#pragma omp parallel num_threads(threads)
  {
    float* code_t = (float*)calloc(col_width * padded, sizeof(float));
    float* b_t = (float*)malloc(sizeof(float) * HIDDEN * padded);
    float* row_dot = (float*)malloc(sizeof(float) * row_width);
    for (int64_t q = 0; q < columns; ++q)
      for (int64_t c = 0; c < col_width; ++c) code_t[c * padded + q] = col_code[q * col_width + c];
#pragma omp for schedule(static)
    for (int64_t job = 0; job < tiles * splits; ++job) {
      const int64_t t = job / splits, split = job % splits;
      const int64_t* at = placement + PLACEMENT * t;
      const int64_t first = split * blocks / splits, stop = (split + 1) * blocks / splits;
      const float* w_in_t = w_in + t * width * HIDDEN;
      const float* b_in_t = b_in + t * HIDDEN;
      column_terms(code_t, w_in_t + row_width * HIDDEN, padded, col_width, b_t);
      const float* w = w_out + t * HIDDEN;
      const float scale = scales[t];
      const int64_t stride = at[STRIDE], cols = at[COLS];
      float row_base = b_out[t];
      for (int h = 0; h < HIDDEN; ++h) row_base += w[h] * b_in_t[h];
      for (int64_t r = 0; r < row_width; ++r) {
        float dot = 0.0f;
        for (int h = 0; h < HIDDEN; ++h) dot += w[h] * w_in_t[r * HIDDEN + h];
        row_dot[r] = dot;
      }
      for (int64_t row_block = first; row_block < stop; ++row_block) {
        const int64_t i = row_block * BLOCK_ROWS;
        if (i >= at[ROWS]) break;
        const int64_t n = at[ROWS] - i < BLOCK_ROWS ? at[ROWS] - i : BLOCK_ROWS;
        float floor[BLOCK_ROWS * HIDDEN], row_bias[BLOCK_ROWS];  // rows past the cut: zeros,
        for (int64_t k = 0; k < BLOCK_ROWS; ++k) {                   // computed and dropped
          float* f = floor + k * HIDDEN;
          for (int h = 0; h < HIDDEN; ++h) f[h] = k < n ? b_in_t[h] : 0.0f;
          row_bias[k] = 0.0f;
          if (k >= n) continue;
          const float* code = row_code + (i + k) * row_width;
          add_terms(code, w_in_t, row_width, f);
#pragma omp simd
          for (int h = 0; h < HIDDEN; ++h) f[h] = -f[h];
          row_bias[k] = row_base;
          for (int64_t r = 0; r < row_width; ++r) row_bias[k] += code[r] * row_dot[r];
        }
        float* dst = weights[at[WEIGHT]] + at[OFFSET] + i * stride;
        int64_t q = 0;
        for (; q + COLUMN_BLOCK <= cols; q += COLUMN_BLOCK)
          block<COLUMN_BLOCK>(floor, row_bias, n, b_t + q, padded, w, scale, dst + q, stride);
        if (q < cols && q + COLUMN_BLOCK <= padded) {  // a cut block: computed whole, copied
          float part[BLOCK_ROWS * COLUMN_BLOCK];
          block<COLUMN_BLOCK>(floor, row_bias, n, b_t + q, padded, w, scale, part,
                              COLUMN_BLOCK);
          for (int64_t k = 0; k < n; ++k)
            memcpy(dst + k * stride + q, part + k * COLUMN_BLOCK, sizeof(float) * (cols - q));
          q = cols;
        }
        for (; q + 8 <= cols; q += 8)
          block<8>(floor, row_bias, n, b_t + q, padded, w, scale, dst + q, stride);
        for (; q < cols; ++q)
          block<1>(floor, row_bias, n, b_t + q, padded, w, scale, dst + q, stride);
      }
    }
    free(code_t);
    free(b_t);
    free(row_dot);
  }
}

// The leaves' gradients given each weight's gradient (NULL: zero), per row split k of each
// tile: g_w_in (T, splits, R + C, H), g_b_in (T, splits, H), g_w_out (T, splits, H),
// g_b_out (T, splits).
extern "C" void relu_tiles_backward(const float* const* grads, const float* row_code,
                                    const float* col_code, const float* w_in, const float* b_in,
                                    const float* w_out, const float* scales,
                                    const int64_t* placement, float* g_w_in, float* g_b_in,
                                    float* g_w_out, float* g_b_out, int64_t tiles, int64_t tile_rows,
                                    int64_t columns, int64_t row_width, int64_t col_width, int64_t splits,
                                    int threads) {
  const int64_t width = row_width + col_width;
#pragma omp parallel num_threads(threads)
  {
    float* b = (float*)malloc(sizeof(float) * columns * HIDDEN);       // column terms
    float* col_sums = (float*)malloc(sizeof(float) * columns * HIDDEN);
#pragma omp for schedule(static)
    for (int64_t job = 0; job < tiles * splits; ++job) {
      const auto [t, at, grad, first, last] =
          backward_job(job, splits, tile_rows, placement, grads);
      const int64_t cols = at[COLS], stride = at[STRIDE];
      const float* w_in_t = w_in + t * width * HIDDEN;
      const float* w = w_out + t * HIDDEN;
      const float scale = scales[t];
      float* g_w_in_job = g_w_in + job * width * HIDDEN;
      float* g_b_in_job = g_b_in + job * HIDDEN;
      float* g_w_out_job = g_w_out + job * HIDDEN;
      float total = 0.0f;
      memset(g_w_in_job, 0, sizeof(float) * width * HIDDEN);
      memset(g_b_in_job, 0, sizeof(float) * HIDDEN);
      memset(g_w_out_job, 0, sizeof(float) * HIDDEN);
      if (first < last) {
        for (int64_t q = 0; q < cols; ++q) {
          float* b_q = b + q * HIDDEN;
          for (int h = 0; h < HIDDEN; ++h) b_q[h] = 0.0f;
          add_terms(col_code + q * col_width, w_in_t + row_width * HIDDEN, col_width, b_q);
        }
        memset(col_sums, 0, sizeof(float) * cols * HIDDEN);
      }
      float w_scaled[HIDDEN];
      for (int h = 0; h < HIDDEN; ++h) w_scaled[h] = scale * w[h];
      for (int64_t i = first; i < last;) {
        const int64_t n = last - i >= BLOCK_ROWS ? BLOCK_ROWS : 1;
        float a[BLOCK_ROWS][HIDDEN], bound[BLOCK_ROWS][HIDDEN], sums[BLOCK_ROWS][HIDDEN];
        for (int64_t k = 0; k < n; ++k) {
          for (int h = 0; h < HIDDEN; ++h) a[k][h] = b_in[t * HIDDEN + h];
          add_terms(row_code + (i + k) * row_width, w_in_t, row_width, a[k]);
#pragma omp simd
          for (int h = 0; h < HIDDEN; ++h) bound[k][h] = -a[k][h];
        }
        const float* g = grad + at[OFFSET] + i * stride;
        if (n == BLOCK_ROWS)
          unit_sums_block<BLOCK_ROWS>(g, stride, bound, b, sums, col_sums, cols, &total);
        else
          unit_sums_block<1>(g, stride, bound, b, sums, col_sums, cols, &total);
        for (int64_t k = 0; k < n; ++k) {
          float g_a[HIDDEN];
#pragma omp simd
          for (int h = 0; h < HIDDEN; ++h) {
            g_a[h] = sums[k][h] * w_scaled[h];
            g_b_in_job[h] += g_a[h];
            g_w_out_job[h] += sums[k][h] * a[k][h];
          }
          add_outer(row_code + (i + k) * row_width, g_a, row_width, g_w_in_job);
        }
        i += n;
      }
      if (first < last) {
        for (int64_t q = 0; q < cols; ++q) {
          const float* col_q = col_sums + q * HIDDEN;
          const float* b_q = b + q * HIDDEN;
          float g_b[HIDDEN];
#pragma omp simd
          for (int h = 0; h < HIDDEN; ++h) {
            g_b[h] = col_q[h] * w_scaled[h];
            g_w_out_job[h] += col_q[h] * b_q[h];
          }
          add_outer(col_code + q * col_width, g_b, col_width, g_w_in_job + row_width * HIDDEN);
        }
      }
#pragma omp simd
      for (int h = 0; h < HIDDEN; ++h) g_w_out_job[h] *= scale;
      g_b_out[job] = scale * total;
    }
    free(b);
    free(col_sums);
  }
}
