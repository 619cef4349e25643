// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#include <cstdint>
#include <string.h>
#define CHUNK 256

// table (T, splits, B): split k of tile t sums its range of positions p into their buckets,
//   table[t, k, |packed[p]| - 1] += sign(packed[p]) * grad[t, p].
extern "C" void hash_table_gradient(const float* grad, const int* packed, float* table,
                                    int64_t tiles, int64_t positions, int64_t buckets, int64_t splits,
                                    int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t job = 0; job < tiles * splits; ++job) {
    const int64_t t = job / splits, split = job % splits;
    const int64_t first = split * positions / splits, last = (split + 1) * positions / splits;
    const float* g = grad + t * positions;
    float* sums = table + job * buckets;
    memset(sums, 0, sizeof(float) * buckets);
    int bucket[CHUNK];
    float value[CHUNK];
    for (int64_t start = first; start < last; start += CHUNK) {
      const int64_t n = last - start < CHUNK ? last - start : CHUNK;
#pragma omp simd
      for (int64_t k = 0; k < n; ++k) {
        const int code = packed[start + k];
        const int negative = code >> 31;  // 0 or -1
        bucket[k] = (code ^ negative) - negative - 1;
        value[k] = code < 0 ? -g[start + k] : g[start + k];
      }
      for (int64_t k = 0; k < n; ++k) sums[bucket[k]] += value[k];
    }
  }
}
