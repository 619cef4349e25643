"""Evaluating a stack's g-nets on its tiles: codes in, `(tiles, TH, TW * K)` raw values out.

This is the pure-torch generation every path shares: `gb.apply`, `gb.init`'s calibration, a
`Selection`'s tiles and the rank-owned g-nets. Laying the tiles out is `_select`'s job.
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from ._plan import TILE_LEAVES, Stack
from ._spec import (
    HASH_GAIN,
    bucket_signs,
    cached,
    code_tables,
    packed_tile_hash,
    per_tile,
    reference,
    stack_terms,
)
from ._tilemlp import op_by_op_form, tile_mlp
from ._tilemlp_forward import (
    EAGER,
    ONE_OUTPUT_UNITS_MAJOR,
    forward_form,
    reads_units_major_columns,
)
from .cpu._hash_gradient import gathered, signed_gather


def evaluate_stack(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    *,
    recompute: bool = True,
    form: str = EAGER,
    compiled: bool = False,
) -> Tensor:
    """Every tile of a stack, `(T, TH, TW * K)`: one batched g-net evaluation.

    Args:
        stack: The stack's description.
        leaves: Its parameters, `gparams["stacks"][stack.key]`.
        recompute: Use the recomputing backward (`tile_mlp`); False runs plain autograd.
        form: The tile MLP's form (`tile_form`): `EAGER`, or traced by `torch.compile`.
        compiled: Run `tile_mlp` eagerly through compiled code in `form` (see `gb.apply`).
    """
    (tiles,) = evaluate_parts(
        stack, leaves, None, recompute=recompute, form=form, compiled=compiled
    )
    return tiles


def evaluate_parts(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    spans: Sequence[tuple[int, int]] | None,
    *,
    recompute: bool = True,
    form: str = EAGER,
    compiled: bool = False,
) -> tuple[Tensor, ...]:
    """`evaluate_stack` cut into the consecutive tile ranges `spans` (None: one part, the
    whole stack), each part with a gradient of its own that the tile MLP's backward takes
    apart (`tile_mlp`)."""
    terms = stack_terms(stack, leaves)
    spans = None if spans is None else tuple(spans)
    if recompute:
        reads_b_t = stack.one_reduction and form in ONE_OUTPUT_UNITS_MAJOR
        b_t = units_major_columns(stack, leaves) if reads_b_t else None
        activation = stack.genome.activation
        parts = tile_mlp(terms, activation, form=form, compiled=compiled, b_t=b_t, spans=spans)
    else:
        y = reference(terms, stack.genome.activation)
        parts = y if spans is None else tuple(y[lo:hi] for lo, hi in spans)
    parts = (parts,) if spans is None else parts
    ranges = spans or ((0, stack.num_tiles),)
    traced = op_by_op_form(form, compiled) != EAGER
    hashed = hashed_tiles(stack, leaves["tile_hash"], traced) if stack.genome.hashed else None
    out = []
    for y, (lo, hi) in zip(parts, ranges, strict=True):
        y = y.reshape(y.shape[0], y.shape[1], -1)
        out.append(y if hashed is None else y + hashed[lo:hi])
    return tuple(out)


def evaluate_tile_parts(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    tiles: Sequence[int],
    spans: Sequence[tuple[int, int]] | None,
    *,
    form: str = EAGER,
    compiled: bool = False,
) -> tuple[Tensor, ...]:
    """Tiles `tiles` (ascending indices into the stack) of a stack, `(len(tiles), TH, TW * K)`,
    cut into `spans`, consecutive ranges of positions in `tiles` (None: one part), each part
    with a gradient of its own (`evaluate_parts`). Only the g-nets of those tiles run;
    gradients flow back into their rows of `leaves`."""
    if len(tiles) == stack.num_tiles:  # ascending and distinct: every tile
        return evaluate_parts(stack, leaves, spans, form=form, compiled=compiled)
    device = leaves["w_in"].device
    owner = stack.gnet_of_tile
    per_gnet = Counter(owner[t] for t in tiles)
    gnets = sorted(per_gnet)
    counts = tuple(per_gnet[g] for g in gnets)
    by_gnet = torch.tensor(gnets, device=device)
    by_tile = torch.tensor(list(tiles), device=device)
    sub = {
        k: v.index_select(0, by_tile if k in TILE_LEAVES else by_gnet) for k, v in leaves.items()
    }
    sub_stack = replace(stack, tiles_per_gnet=counts)
    return evaluate_parts(sub_stack, sub, spans, form=form, compiled=compiled)


def hashed_tiles(stack: Stack, table: Tensor, traced: bool) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`, `traced`
    by `torch.compile` or not."""
    positions = stack.tile_positions
    # torch.gather, not index_select: its backward is a scatter_add, which inductor's CPU code
    # leaves to torch's kernel, where index_select's index_add becomes a scatter of atomic
    # adds.
    if traced:
        packed = _packed_tile_hash_op(positions, stack.genome.hashed, table.device)
        # A view: under `torch.func.grad`, dynamo drops the backward of a Function applied to
        # the transformed function's own argument and differentiates its forward instead
        # (pytorch/pytorch#193279, torch 2.13), which kept torch's scatter-add and the int64
        # index inductor writes for it.
        shared = signed_gather(table.view_as(table), packed) * HASH_GAIN  # backward: in C
    else:
        bucket, sign = cached(
            bucket_signs, positions, stack.genome.hashed, table.dtype, table.device
        )
        shared = gathered(table, bucket, sign * HASH_GAIN)
    return shared.reshape(table.shape[0], stack.tile[0], -1)


def units_major_columns(stack: Stack, leaves: Mapping[str, Tensor]) -> Tensor:
    """`stack_terms(stack, leaves).b` laid out units-major, `(T, H, Q)`: a matmul's own
    output, which compiled code reads with the columns as the vector axis (`tile_mlp`)."""
    w_in = leaves["w_in"]
    _, col = code_tables(stack, w_in)
    b_t = w_in[:, stack.row_width :].mT @ col.mT  # (G, H, Q)
    return per_tile(b_t, stack.tiles_per_gnet) if stack.genome.share else b_t


def _reads_units_major(stack: Stack, w_in: Tensor, traced: bool) -> bool:
    """Whether the tile MLP's forward runs as compiled code that reads `units_major_columns`:
    one hidden layer and one output (a fused reduction), `traced` (by `torch.compile`, or
    compiled eagerly), on tiles wide enough for it (`reads_units_major_columns`)."""
    wide = reads_units_major_columns(stack.columns, w_in.dtype, w_in.device)
    return stack.one_reduction and wide and traced


def tile_form(stack: Stack, w_in: Tensor, *, traced: bool, exporting: bool) -> str:
    """The form of the tile MLP's forward (`forward_form`) that `evaluate_parts` runs for
    `stack` with first layers `w_in`: `traced` by `torch.compile` or in gbfunc's compiled
    bodies (`compiled=True`, never exporting)."""
    genome = stack.genome
    return forward_form(
        one_layer=genome.depth == 1,
        hidden=genome.hidden,
        outputs=stack.outputs,
        activation=genome.activation,
        dtype=w_in.dtype,
        device_type=w_in.device.type,
        traced=traced,
        exporting=exporting,
        units_major_columns=_reads_units_major(stack, w_in, traced),
    )


@torch.library.custom_op("gbfunc::tile_hash", mutates_args=())
def _packed_tile_hash_op(positions: int, buckets: int, device: torch.device) -> Tensor:
    """The cached `packed_tile_hash` as one opaque operation for `torch.compile`: traced, the
    hash's argsort and integer arithmetic would run in every compiled step. Returns a copy,
    so that the compiled code may reuse its memory without touching the cache. Packed,
    bucket and sign copy 4 bytes a position, not 12 (int64 and float32), and unpack inside
    the gather's kernel, which lowers a compiled step's peak (measured:
    `benchmarks/results/design_measurements.md`)."""
    return cached(packed_tile_hash, positions, buckets, device).clone()


@_packed_tile_hash_op.register_fake
def _(positions: int, buckets: int, device: torch.device) -> Tensor:
    return torch.empty(positions, dtype=torch.int32, device=device)
