// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#pragma once

// acc[k][n] += sum_i a[k][i] w[i * N + n], for rows k < ROWS, i < K, n < N: a block of rows
// times a matrix, register-blocked: the ROWS x N sums stay in registers across the loop over
// i, each row of w serves every row of the block, and the sums are vectorised over n (no
// horizontal sums). `a` is any block indexed a[k][i]: an array or an array of row pointers.
template <int ROWS, int K, int N, typename Block>
static inline void add_block_products(float (&acc)[ROWS][N], const Block& a, const float* w) {
  for (int i = 0; i < K; ++i) {
    const float* w_i = w + i * N;
    for (int k = 0; k < ROWS; ++k) {
      const float x = a[k][i];
#pragma omp simd
      for (int n = 0; n < N; ++n) acc[k][n] += x * w_i[n];
    }
  }
}
