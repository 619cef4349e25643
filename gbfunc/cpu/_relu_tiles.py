"""One-output g-nets with one ReLU layer on CPU: from their leaves straight to the weights, in C.

A one-output g-net (`Stack.outputs == 1`) is evaluated at every position of its tile:
`w[i, q] = b_out + sum_h w_out[h] relu(a[i, h] + b[q, h])`, with row terms
`a = row_code @ w_in[:R] + b_in` and column terms `b = col_code @ w_in[R:]`. Through the
tile MLP that is five batched matmuls for the terms (three forward, two backward, each
contracting ten-odd code bits, where MKL's calls cost more than their arithmetic), a loop
writing `(T, TH, Q)` tiles, a copy laying them out on the weights, and in the backward a copy
of the weights' gradients back into tiles. Here the forward computes each tile's terms and
writes its cut rows, scaled, where they land in the weight; the backward reads each weight's
gradient in place and returns the leaves' gradients. `_relu_rows` holds the glue the two
kinds share (placement, custom ops, autograd, `vmap`) and calls these two loops for
one-output stacks. Eagerly the plan also skips its compiled graph (`gb.apply`), as row
g-nets do.

The sums are those of `_relu_loops`' `relu_one_output` (four rows' sums in registers per 32
columns) and `relu_unit_sums` (a row's masked sums in registers while the same selected
gradient is added into the columns' sums), with the terms' products and the leaves'
gradients folded in: ReLU is homogeneous, so `w_out`'s gradient follows from the two masked
sums, `sum_i rows[i] * a[i] + sum_q cols[q] * b[q]`, without a third pass.

Two instructions per unit and position forward, three backward (AVX-512): the forward sums
`w[h] max(b[q, h], -a[i, h])` and adds each row's `sum_h w[h] a[i, h]` once (`relu(a + b) =
max(b, -a) + a`), where `w[h] relu(a + b)` took four (GCC compiles the ReLU to a compare and a
masked move); the backward's masked sums compare into a mask and add under it twice, written
with intrinsics (GCC's code also broadcast under the mask, on the compare's port). The row
sums come from per-tile dot products and the column terms are summed in registers.

The measurements behind these choices are in `benchmarks/results/design_measurements.md`.
"""

from ._build import Loop

# Rows per block of the forward (its `BLOCK_ROWS`): tiles split into row ranges by blocks.
BLOCK_ROWS = 4
FORWARD = Loop("relu_tiles_forward", "relu_tiles.cpp", pointers=9, sizes=6)
BACKWARD = Loop("relu_tiles_backward", "relu_tiles.cpp", pointers=12, sizes=6)
