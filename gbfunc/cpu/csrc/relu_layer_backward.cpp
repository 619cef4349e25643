// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
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
      x[k][h] = 0.0f > z[k][h] ? 0.0f : z[k][h];
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
                                    float* g_w, int64_t tiles, int64_t tile_rows, int64_t columns,
                                    int64_t splits, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t job = 0; job < tiles * splits; ++job) {
    const int64_t t = job / splits, split = job % splits;
    const int64_t first = split * tile_rows / splits, last = (split + 1) * tile_rows / splits;
    const float* w = w_out + t * HIDDEN * OUTPUTS;
    float w_t[OUTPUTS][HIDDEN];
    for (int h = 0; h < HIDDEN; ++h)
      for (int p = 0; p < OUTPUTS; ++p) w_t[p][h] = w[h * OUTPUTS + p];
    float* cols = g_cols + job * columns * HIDDEN;
    float* g_w_job = g_w + job * HIDDEN * OUTPUTS;
    memset(cols, 0, sizeof(float) * columns * HIDDEN);
    memset(g_w_job, 0, sizeof(float) * HIDDEN * OUTPUTS);
    const float* b_t = b + t * columns * HIDDEN;
    for (int64_t i = first; i < last; ++i) {
      const float* row = row_terms + (t * tile_rows + i) * HIDDEN;
      const float* g = grad + (t * tile_rows + i) * columns * OUTPUTS;
      float rows[HIDDEN];
      for (int h = 0; h < HIDDEN; ++h) rows[h] = 0.0f;
      int64_t q = 0;
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
