// Part of gbfunc's CPU loops (gbfunc/cpu): see the Python module that runs it.
#pragma once
#include <cstdint>
// A tile's placement: [weight, offset of its first element, the weight's row stride,
// rows, columns] (rows and columns inside the weight: fewer than the tile's at a ragged edge).
enum { WEIGHT, OFFSET, STRIDE, ROWS, COLS, PLACEMENT };

// A backward job: row split `job % splits` of tile `job / splits` (of `tile_rows` rows),
// its placement `at`, its weight's gradient `grad` (NULL: zero) and the rows [first, last)
// it reads: cut at the weight's last row, none where `grad` is NULL.
struct BackwardJob {
  int64_t tile;
  const int64_t* at;
  const float* grad;
  int64_t first, last;
};

static inline BackwardJob backward_job(int64_t job, int64_t splits, int64_t tile_rows,
                                       const int64_t* placement, const float* const* grads) {
  const int64_t tile = job / splits, split = job % splits;
  const int64_t* at = placement + PLACEMENT * tile;
  const float* grad = grads[at[WEIGHT]];
  const int64_t first = split * tile_rows / splits, stop = (split + 1) * tile_rows / splits;
  const int64_t last = grad == 0 ? first : (stop < at[ROWS] ? stop : at[ROWS]);
  return {tile, at, grad, first, last};
}
