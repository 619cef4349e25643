// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#pragma once
#include <cstdint>
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
static inline void block(const float* floor, const float* row_bias, int64_t n, const float* b_t,
                         int64_t columns, const float* w, float scale, float* dst, int64_t stride) {
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
        acc[k][j] += (f > c ? f : c) * w_h;  // maxps: a NaN c kept (f's is in row_bias)
      }
    }
  }
  for (int64_t k = 0; k < n; ++k)
#pragma omp simd
    for (int j = 0; j < W; ++j) dst[k * stride + j] = scale * acc[k][j];
}
