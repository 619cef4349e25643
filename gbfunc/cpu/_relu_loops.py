"""Loops in C for one-layer ReLU g-nets on CPU, where inductor's code does redundant work.

- `relu_unit_sums`, for the backward of one-output g-nets: for each tile,
  `generate._traced_forms._fused_reductions` needs the output gradient `g` `(TH, Q)`
  summed where each hidden unit is active (`b[q, h] > threshold[i, h]`,
  `threshold = -(a + c)`): over the columns, `rows` `(TH, H)`, and over the rows, `cols`
  `(Q, H)`. Written for inductor these are two reductions along different axes: two passes
  over the positions, each a compare, a select and an add per position and unit. The loop
  makes one: per row it keeps the row's sums in registers, vectorised over the units, and
  adds the same selected gradient into the columns' sums, which stay in L1. Four rows at a
  time share each load of `b` and each update of the columns' sums.
- `relu_one_output`, for the forward of one-output g-nets
  (`generate._traced_forms.forward_form`): inductor's sum over the units, vectorised
  over the columns, reloads each unit's column terms for every row; the loop holds four
  rows' sums in registers, so one load serves the four.
- `relu_layer_forward`, for the forward of g-nets with a few outputs (up to 32,
  `generate._traced_forms._loops_layer`): inductor's unrolled sum recomputes every
  hidden activation once per output; the loop computes a position's activations once,
  vectorised over the units, then its outputs as a sum of rows of `w_out`, vectorised over
  the outputs, eight positions at a time (then four, then one; eight independent chains of
  multiply-adds).
- `relu_layer_backward`, its backward: inductor's (from
  `generate._bodies._backward_units_major`) is two matmuls with 32 or fewer
  outputs as their short axis, where MKL is slow, and reductions around them; the loop
  recomputes a position's activations, their gradient, and adds into every sum (over the
  columns, the rows, the positions) in one pass. Four positions at a time share each pass
  over `w_out`'s gradient and each row of `w_out`; units that do not fill 4-lane vectors go
  one position at a time.

Each loop is built once per shape constant (units, outputs) by `_build` (see its docstring)
and runs as a custom op (`gbfunc::...`), opaque to inductor, with fake, vmap and autograd
rules (the latter by autograd through the torch specification). `sums_usable`,
`one_output_usable` and `layer_usable` say where: CPU float32 and enough units; elsewhere,
or where the build fails, inductor's code runs instead. The measurements behind these
choices are in `benchmarks/results/design_measurements.md`.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from ._build import (
    Loop,
    compiled_loop,
    launch,
    splits_added,
    threads_and_splits,
    tiles_folded,
    tiles_unfolded,
    vectorised_cpu,
)

# Units per compiled loop. Fewer than 4 do not fill the narrowest vector (SSE's 4 floats):
# inductor's reductions along the positions are faster there. At most 512: a position's or
# a row's values live on the stack, in registers.
MIN_UNITS = 4
MAX_UNITS = 512


_SUMS = Loop("relu_unit_sums", "relu_unit_sums.cpp", pointers=5, sizes=4)
_FORWARD = Loop("relu_layer_forward", "relu_layer_forward.cpp", pointers=5, sizes=3)
_BACKWARD = Loop("relu_layer_backward", "relu_layer_backward.cpp", pointers=7, sizes=4)
_ONE_OUTPUT = Loop("relu_one_output", "relu_one_output.cpp", pointers=4, sizes=3)


def _differentiated_as(op: torch.library.CustomOpDef, reference: Callable) -> None:
    """Give the custom op `op` the gradients of its specification `reference`, by autograd
    through it (for double backward and transforms that differentiate the op itself, which
    are rare: the reference materialises what the loop avoids)."""

    def setup_context(ctx, inputs: tuple, output) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        given = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if grad is not None]
        if not given:
            return (None,) * len(inputs)
        outputs, grads = zip(*given, strict=True)
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)

    op.register_autograd(backward, setup_context=setup_context)


def sums_reference(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`(rows, cols)` as `relu_unit_sums` computes them, in plain torch: the specification.

    Shapes: g `(T, TH, Q)`, threshold `(T, TH, H)`, b `(T, Q, H)`; rows `(T, TH, H)`, cols
    `(T, Q, H)`. A unit is active where `b > threshold` (a tie is not active).
    """
    selected = torch.where(b[:, None] > threshold[:, :, None], g[..., None], 0.0)
    return selected.sum(2), selected.sum(1)


def forward_reference(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    """`relu_layer_forward` in plain torch: the specification.

    Shapes: row_terms `(T, TH, H)` (`a + c`), b `(T, Q, H)`, w_out `(T, H, P)`, b_out
    `(T, P)`; returns `(T, TH, Q, P)`.
    """
    hidden = torch.relu(row_terms[:, :, None, :] + b[:, None, :, :])
    return torch.einsum("tiqh,thp->tiqp", hidden, w_out) + b_out[:, None, None, :]


def one_output_reference(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    """`relu_one_output` in plain torch: the specification.

    Shapes: row_terms `(T, TH, H)` (`a + c`), b_t `(T, H, Q)` (column terms, units-major),
    w `(T, H)`; returns `(T, TH, Q)`, without the output bias.
    """
    hidden = torch.relu(row_terms[:, :, :, None] + b_t[:, None, :, :])  # (T, TH, H, Q)
    return (hidden * w[:, None, :, None]).sum(2)


def backward_reference(
    grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`relu_layer_backward` in plain torch: the gradients of `forward_reference` w.r.t.
    `row_terms`, `b` and `w_out`, given `grad` `(T, TH, Q, P)` (that of `b_out` is
    `grad.sum((1, 2))`)."""
    z = row_terms[:, :, None, :] + b[:, None, :, :]  # (T, TH, Q, H)
    g_z = torch.einsum("tiqp,thp->tiqh", grad, w_out) * (z > 0)
    g_w_out = torch.einsum("tiqh,tiqp->thp", torch.relu(z), grad)
    return g_z.sum(2), g_z.sum(1), g_w_out


@torch.compiler.assume_constant_result
def sums_usable(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_unit_sums` runs its C loop for `units` hidden units: CPU float32 with a
    vector ISA inductor knows, `MIN_UNITS` to `MAX_UNITS` units, and the loop compiled."""
    if not supported(units, dtype, device_type):
        return False
    return compiled_loop(_SUMS, units) is not None


@torch.compiler.assume_constant_result
def layer_usable(units: int, outputs: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_layer_forward` and `relu_layer_backward` run their C loops for a layer
    of `units` units and `outputs` outputs: as `sums_usable`, for 1 to 64 outputs."""
    if not supported(units, dtype, device_type) or not 1 <= outputs <= 64:
        return False
    return all(compiled_loop(loop, units, outputs) is not None for loop in (_FORWARD, _BACKWARD))


@torch.compiler.assume_constant_result
def one_output_usable(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether `relu_one_output` runs its C loop for `units` hidden units: as `sums_usable`."""
    return supported(units, dtype, device_type) and compiled_loop(_ONE_OUTPUT, units) is not None


@torch.library.custom_op("gbfunc::relu_unit_sums", mutates_args=(), device_types="cpu")
def relu_unit_sums(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """`sums_reference(g, threshold, b)` by the C loop (`sums_usable` must hold)."""
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    g, threshold, b = g.contiguous(), threshold.contiguous(), b.contiguous()
    threads, splits = threads_and_splits(tiles, tile_rows)
    rows = g.new_empty(tiles, tile_rows, units)
    cols = g.new_empty(tiles, splits, columns, units)
    launch(_SUMS, units, 1, g, threshold, b, rows, cols, tiles, tile_rows, columns, splits, threads)
    return rows, splits_added(cols)


@relu_unit_sums.register_fake
def _(g: Tensor, threshold: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    tiles, tile_rows, columns = g.shape
    units = threshold.shape[-1]
    return g.new_empty(tiles, tile_rows, units), g.new_empty(tiles, columns, units)


@relu_unit_sums.register_vmap
def _(info, in_dims: tuple, g: Tensor, threshold: Tensor, b: Tensor) -> tuple:
    rows, cols = relu_unit_sums(*tiles_folded(info.batch_size, in_dims, (g, threshold, b)))
    return (tiles_unfolded(info.batch_size, rows), tiles_unfolded(info.batch_size, cols)), (0, 0)


_differentiated_as(relu_unit_sums, sums_reference)


@torch.library.custom_op("gbfunc::relu_one_output", mutates_args=(), device_types="cpu")
def relu_one_output(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    """`one_output_reference(row_terms, b_t, w)` by the C loop (`one_output_usable` must
    hold), contiguous."""
    tiles, tile_rows, units = row_terms.shape
    columns = b_t.shape[-1]
    row_terms, b_t, w = (x.contiguous() for x in (row_terms, b_t, w))
    out = row_terms.new_empty(tiles, tile_rows, columns)
    sizes = (tiles, tile_rows, columns)
    launch(_ONE_OUTPUT, units, 1, row_terms, b_t, w, out, *sizes, torch.get_num_threads())
    return out


@relu_one_output.register_fake
def _(row_terms: Tensor, b_t: Tensor, w: Tensor) -> Tensor:
    return row_terms.new_empty(*row_terms.shape[:2], b_t.shape[-1])


@relu_one_output.register_vmap
def _(info, in_dims: tuple, row_terms: Tensor, b_t: Tensor, w: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (row_terms, b_t, w))
    return tiles_unfolded(info.batch_size, relu_one_output(*folded)), 0


_differentiated_as(relu_one_output, one_output_reference)


@torch.library.custom_op("gbfunc::relu_layer_forward", mutates_args=(), device_types="cpu")
def relu_layer_forward(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    """`forward_reference(row_terms, b, w_out, b_out)` by the C loop (`layer_usable` must
    hold), contiguous."""
    tiles, tile_rows, units = row_terms.shape
    columns, outputs = b.shape[1], w_out.shape[-1]
    row_terms, b, w_out, b_out = (x.contiguous() for x in (row_terms, b, w_out, b_out))
    out = row_terms.new_empty(tiles, tile_rows, columns, outputs)
    sizes = (tiles, tile_rows, columns, torch.get_num_threads())
    launch(_FORWARD, units, outputs, row_terms, b, w_out, b_out, out, *sizes)
    return out


@relu_layer_forward.register_fake
def _(row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor) -> Tensor:
    tiles, tile_rows, _ = row_terms.shape
    return row_terms.new_empty(tiles, tile_rows, b.shape[1], w_out.shape[-1])


@relu_layer_forward.register_vmap
def _(info, in_dims: tuple, row_terms: Tensor, b: Tensor, w_out: Tensor, b_out: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (row_terms, b, w_out, b_out))
    return tiles_unfolded(info.batch_size, relu_layer_forward(*folded)), 0


_differentiated_as(relu_layer_forward, forward_reference)


@torch.library.custom_op("gbfunc::relu_layer_backward", mutates_args=(), device_types="cpu")
def relu_layer_backward(
    grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`backward_reference(grad, row_terms, b, w_out)` by the C loop (`layer_usable` must
    hold): for each position the hidden activations once, their gradient from `w_out`'s
    columns, and every sum (over the columns, the rows, the positions) in one pass."""
    tiles, tile_rows, units = row_terms.shape
    columns, outputs = b.shape[1], w_out.shape[-1]
    grad, row_terms, b, w_out = (x.contiguous() for x in (grad, row_terms, b, w_out))
    threads, splits = threads_and_splits(tiles, tile_rows)
    g_rows = grad.new_empty(tiles, tile_rows, units)
    g_cols = grad.new_empty(tiles, splits, columns, units)
    g_w_out = grad.new_empty(tiles, splits, units, outputs)
    tensors = (grad, row_terms, b, w_out, g_rows, g_cols, g_w_out)
    launch(_BACKWARD, units, outputs, *tensors, tiles, tile_rows, columns, splits, threads)
    return g_rows, splits_added(g_cols), splits_added(g_w_out)


@relu_layer_backward.register_fake
def _(grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor) -> tuple:
    return row_terms.new_empty(row_terms.shape), b.new_empty(b.shape), w_out.new_empty(w_out.shape)


@relu_layer_backward.register_vmap
def _(info, in_dims: tuple, grad: Tensor, row_terms: Tensor, b: Tensor, w_out: Tensor):
    folded = tiles_folded(info.batch_size, in_dims, (grad, row_terms, b, w_out))
    out = relu_layer_backward(*folded)
    return tuple(tiles_unfolded(info.batch_size, x) for x in out), (0, 0, 0)


_differentiated_as(relu_layer_backward, backward_reference)


def supported(units: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether loops for `units` hidden units can run here: `MIN_UNITS` to `MAX_UNITS` units,
    where `vectorised_cpu` holds."""
    return MIN_UNITS <= units <= MAX_UNITS and vectorised_cpu(dtype, device_type)
