// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include "block_products.h"
// out (T, TH, Q, P): out[t, i, q] = b_out[t] + sum_h relu(row[t, i, h] + b[t, q, h]) w_out[t, h].
template <int BLOCK>
static inline void positions(const float* row, const float* b, const float* w,
                             const float* bias, float* out) {
  float hidden[BLOCK][HIDDEN], acc[BLOCK][OUTPUTS];
  for (int k = 0; k < BLOCK; ++k) {
#pragma omp simd
    for (int h = 0; h < HIDDEN; ++h) {
      const float z = row[h] + b[k * HIDDEN + h];
      hidden[k][h] = 0.0f > z ? 0.0f : z;  // a NaN z kept (as torch.relu): one maxps
    }
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) acc[k][p] = bias[p];
  }
  add_block_products<BLOCK, HIDDEN, OUTPUTS>(acc, hidden, w);
  for (int k = 0; k < BLOCK; ++k)
#pragma omp simd
    for (int p = 0; p < OUTPUTS; ++p) out[k * OUTPUTS + p] = acc[k][p];
}

extern "C" void relu_layer_forward(const float* row_terms, const float* b, const float* w_out,
                                   const float* b_out, float* out, int64_t tiles, int64_t tile_rows,
                                   int64_t columns, int threads) {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t i = 0; i < tile_rows; ++i) {
      const float* row = row_terms + (t * tile_rows + i) * HIDDEN;
      const float* b_t = b + t * columns * HIDDEN;
      const float* w = w_out + t * HIDDEN * OUTPUTS;
      const float* bias = b_out + t * OUTPUTS;
      float* o = out + (t * tile_rows + i) * columns * OUTPUTS;
      int64_t q = 0;
      for (; q + 8 <= columns; q += 8)
        positions<8>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
      for (; q + 4 <= columns; q += 4)
        positions<4>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
      for (; q < columns; ++q) positions<1>(row, b_t + q * HIDDEN, w, bias, o + q * OUTPUTS);
    }
  }
}
