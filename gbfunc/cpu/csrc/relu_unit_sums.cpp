// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include "unit_sums_block.h"
#include <string.h>

// Rows i .. i + R - 1 of a tile (g, threshold and rows from row i), by `unit_sums_block`.
template <int R>
static inline void row_block(const float* g, const float* threshold, const float* b,
                             float* rows, float* col_sums, int64_t columns) {
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
                               float* rows, float* cols, int64_t tiles, int64_t tile_rows,
                               int64_t columns, int64_t splits, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t job = 0; job < tiles * splits; ++job) {
    const int64_t t = job / splits, split = job % splits;
    const int64_t first = split * tile_rows / splits, last = (split + 1) * tile_rows / splits;
    const float* b_t = b + t * columns * HIDDEN;
    float* col_sums = cols + job * columns * HIDDEN;
    memset(col_sums, 0, sizeof(float) * columns * HIDDEN);
    int64_t i = first;
    for (; i + 4 <= last; i += 4) {
      const int64_t row = t * tile_rows + i;
      row_block<4>(g + row * columns, threshold + row * HIDDEN, b_t, rows + row * HIDDEN,
                   col_sums, columns);
    }
    for (; i < last; ++i) {
      const int64_t row = t * tile_rows + i;
      row_block<1>(g + row * columns, threshold + row * HIDDEN, b_t, rows + row * HIDDEN,
                   col_sums, columns);
    }
  }
}
