// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#pragma once
#include <cstdint>
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
static inline void unit_sums_block(const float* g, int64_t stride, const float (*bound)[HIDDEN],
                                   const float* b, float (*sums)[HIDDEN], float* col_sums,
                                   int64_t cols, float* total) {
  for (int v = 0; v < HIDDEN; v += 16) {
    __m512 sum[R], threshold[R];
    for (int r = 0; r < R; ++r) {
      sum[r] = _mm512_setzero_ps();
      threshold[r] = _mm512_loadu_ps(bound[r] + v);
    }
    for (int64_t q = 0; q < cols; ++q) {
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
    for (int64_t q = 0; q < cols; ++q) row_total += g[r * stride + q];
    *total += row_total;
  }
}
#else
// The column's sum is loaded first and added to in turn: adding the rows' total to it at the
// end made GCC's code for units that do not fill whole vectors 1.4-5x slower (44 (128, 128)
// tiles, 5-28 units). Each row keeps its own total: one total for all took R dependent adds
// per column.
template <int R>
static inline void unit_sums_block(const float* g, int64_t stride, const float (*bound)[HIDDEN],
                                   const float* b, float (*sums)[HIDDEN], float* col_sums,
                                   int64_t cols, float* total) {
  float row_totals[R];
  for (int r = 0; r < R; ++r) {
    row_totals[r] = 0.0f;
    for (int h = 0; h < HIDDEN; ++h) sums[r][h] = 0.0f;
  }
  for (int64_t q = 0; q < cols; ++q) {
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
