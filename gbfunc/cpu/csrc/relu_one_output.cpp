// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include "one_output_block.h"
// out (T, TH, Q) from row_terms (T, TH, H), b_t (T, H, Q) and w (T, H).
extern "C" void relu_one_output(const float* row_terms, const float* b_t, const float* w,
                                float* out, int64_t tiles, int64_t tile_rows, int64_t columns,
                                int threads) {
  const int64_t blocks = (tile_rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t row_block = 0; row_block < blocks; ++row_block) {
      const int64_t i = row_block * BLOCK_ROWS;
      const int64_t n = tile_rows - i < BLOCK_ROWS ? tile_rows - i : BLOCK_ROWS;
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
      int64_t q = 0;
      for (; q + COLUMN_BLOCK <= columns; q += COLUMN_BLOCK)
        block<COLUMN_BLOCK>(floor, row_bias, n, b + q, columns, w_t, 1.0f, o + q, columns);
      for (; q < columns; ++q)
        block<1>(floor, row_bias, n, b + q, columns, w_t, 1.0f, o + q, columns);
    }
  }
}
