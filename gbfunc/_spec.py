"""The specification of generation: what a stack's g-nets compute, with no choice of how.

A stack's g-nets as per-tile terms of the separable first layer (`Terms`, `stack_terms`),
the position-code tables they read (`code_tables`), the activations and their derivatives,
the tile hash and a hashed table's signed gather (`signed_buckets`, and its gradient), and
`reference`: the tile MLP in plain autograd, which defines what every generation path (the
compiled torch forms, the C loops, the Triton kernels) must return. One helper serves how
rather than what: for traced code, the tile hash as one opaque op that reads its cache
(`tile_hash_op`), so that a compiled step does not recompute it.
`gbfunc.cpu` and `gbfunc.kernels` import this module, the plan and `_function` (the loops
`_tracing` too, the kernels' reference the tiling), nothing above them
(`tests/test_import_graph.py`). What torch does to a call (tracing, transforms, autocast)
is `_tracing`'s.
"""

import math
from collections.abc import Callable, Hashable, Mapping
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ._genome import hash_buckets, stack_codes
from ._plan import Stack

Tensors = tuple[Tensor, Tensor]
Made = TypeVar("Made", Tensor, Tensors)
# Hashed tables are stored divided by this, so one learning rate suits them and the g-nets: a
# table learns best at about ten times the g-nets' Adam rate (measured on the digits CNN:
# benchmarks/results/design_measurements.md).
HASH_GAIN = 10.0


class Terms(NamedTuple):
    """A stack's g-nets as per-tile terms: the inputs of the tile MLP and of the fused kernels.

    Shapes, after any leading batch (genome) dims: `a` `(T, TH, H)` row terms and `b`
    `(T, Q, H)` column terms of the separable first layer, `c` `(T, H)` its bias;
    `w_hidden` `(T, D-1, H, H)` and `b_hidden` `(T, D-1, H)`, or `None` for one hidden layer;
    `w_out` `(T, H, P)`, `b_out` `(T, P)`. Gradients come back as `Terms` of the same shapes.
    """

    a: Tensor
    b: Tensor
    c: Tensor
    w_hidden: Tensor | None
    b_hidden: Tensor | None
    w_out: Tensor
    b_out: Tensor | None

    def tiles(self, lo: int, hi: int) -> "Terms":
        """The terms of tiles `lo:hi` (the first axis)."""
        return Terms(*(tile_rows(x, lo, hi) for x in self))

    @staticmethod
    def one_layer_gradients(g_a: Tensor, g_b: Tensor, g_w_out: Tensor, grad: Tensor) -> "Terms":
        """The gradients of one-hidden-layer terms from those of `a`, `b` and `w_out` and the
        output's gradient `grad` `(T, TH, Q, P)`: `c`'s is `a`'s summed over the rows (`c` is
        added to every row term), `b_out`'s is `grad` summed over the positions."""
        return Terms(g_a, g_b, g_a.sum(1), None, None, g_w_out, grad.sum((1, 2)))

    @property
    def one_reduction(self) -> bool:
        """One hidden layer and one output (`Stack.one_reduction`): a single fused reduction
        over the hidden units, forward and backward."""
        return self.w_hidden is None and self.w_out.shape[-1] == 1


def activate(z: Tensor, activation: str) -> Tensor:
    """Apply the named activation."""
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "tanh":
        return torch.tanh(z)
    if activation == "silu":
        return F.silu(z)
    raise ValueError(f"unknown activation {activation!r}")


def activate_grad(z: Tensor, activation: str) -> Tensor:
    """Derivative of the named activation at `z`."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
        return cdf + z * pdf
    if activation == "tanh":
        return 1.0 - torch.tanh(z) ** 2
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    raise ValueError(f"unknown activation {activation!r}")


def first_layer(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    # `(a + c) + b`, in that order: `_fused_reductions` tests `b > -(a + c)`, the same sign.
    return (a + c[:, None])[:, :, None, :] + b[:, None, :, :]  # (T, TH, Q, H)


def reference(terms: Terms, activation: str) -> Tensor:
    """Outputs of every g-net of a stack at every position of its tile.

    Args:
        terms: The stack's g-nets, see `Terms`.
        activation: Name of the activation.

    Returns:
        `(T, TH, Q, P)`: `out[t, i, q] = mlp_t(code(i, q))`.
    """
    a, b, c, w_hidden, b_hidden, w_out, b_out = terms
    h = activate(first_layer(a, b, c), activation)
    for layer in range(0 if w_hidden is None else w_hidden.shape[1]):
        z = torch.einsum("tiqh,thk->tiqk", h, w_hidden[:, layer]) + b_hidden[:, layer, None, None]
        h = activate(z, activation)
    return torch.einsum("tiqh,thp->tiqp", h, w_out) + b_out[:, None, None, :]


def reference_jvp(
    terms: Terms, tangents: Terms, activation: str, stride: tuple[int, ...]
) -> Tensor:
    """The change of `reference(terms, activation)` along `tangents` (forward mode: `jvp`,
    `jacfwd`, `hessian`; a tangent may be None, zero), laid out in the order of `stride`
    (forward mode asks outputs that are views for tangents laid out as they are)."""

    def plus(*parts: Tensor | None) -> Tensor | float:
        return sum((x for x in parts if x is not None), start=0.0)

    a, b, c, w_hidden, b_hidden, w_out, _ = terms
    da, db, dc, dw_hidden, db_hidden, dw_out, db_out = tangents
    z = first_layer(a, b, c)
    dz = plus(
        None if da is None else da[:, :, None, :],
        None if db is None else db[:, None, :, :],
        None if dc is None else dc[:, None, None, :],
    )
    h, dh = activate(z, activation), activate_grad(z, activation) * dz
    for layer in range(0 if w_hidden is None else w_hidden.shape[1]):
        w = w_hidden[:, layer]
        z = torch.einsum("tiqh,thk->tiqk", h, w) + b_hidden[:, layer, None, None]
        dz = plus(
            torch.einsum("tiqh,thk->tiqk", dh, w),
            None if dw_hidden is None else torch.einsum("tiqh,thk->tiqk", h, dw_hidden[:, layer]),
            None if db_hidden is None else db_hidden[:, layer, None, None],
        )
        h, dh = activate(z, activation), activate_grad(z, activation) * dz
    out = torch.einsum("tiqh,thp->tiqp", dh, w_out)
    if dw_out is not None:
        out = out + torch.einsum("tiqh,thp->tiqp", h, dw_out)
    out = out if db_out is None else out + db_out[:, None, None, :]
    order = sorted(range(out.dim()), key=lambda d: -stride[d])
    return out.permute(order).contiguous().permute(sorted(range(out.dim()), key=order.__getitem__))


def stack_terms(stack: Stack, leaves: Mapping[str, Tensor]) -> Terms:
    """A stack's g-nets as per-tile `Terms`, from its leaves in `gparams["stacks"]`.

    The code tables go through the first layer here (`a`, `b`); `c` is its bias plus the
    tile embedding when g-nets are shared, and shared g-nets are repeated over their tiles.
    """
    w_in = leaves["w_in"]
    row, col = code_tables(stack, w_in)
    # One split, not two slices: its backward is one concatenation, where each slice's
    # allocates and fills a zero gradient of the whole leaf (launches on a GPU).
    w_row, w_col = w_in.split([stack.row_width, w_in.shape[1] - stack.row_width], dim=1)
    a = row @ w_row  # (G, TH, H)
    b = col @ w_col  # (G, Q, H)
    c = leaves["b_in"]  # (G, H)
    w_hidden, b_hidden = leaves.get("w_hidden"), leaves.get("b_hidden")
    w_out, b_out = leaves["w_out"], leaves["b_out"]
    if stack.genome.share:
        counts = stack.tiles_per_gnet
        w_embed = per_tile(leaves["w_embed"], counts)  # (T, E, H)
        c = per_tile(c, counts) + torch.einsum("te,teh->th", leaves["tile_embed"], w_embed)
        a, b, w_out, b_out = (per_tile(x, counts) for x in (a, b, w_out, b_out))
        if w_hidden is not None:
            w_hidden, b_hidden = per_tile(w_hidden, counts), per_tile(b_hidden, counts)
    return Terms(a, b, c, w_hidden, b_hidden, w_out, b_out)


def code_tables(stack: Stack, w_in: Tensor) -> Tensors:
    """The stack's row and column code tables, in `w_in`'s dtype and on its device."""
    return _constant(
        stack_codes, stack.tile, stack.window, stack.genome, stack.columns, w_in.dtype, w_in.device
    )


def cached_tile_hash(positions: int, buckets: int, device: torch.device) -> Tensor:
    """`packed_tile_hash`, cached: for code that reads it outside any traced graph (the C
    loops of `_hash_weights`), where no copy is needed (`tile_hash_op`'s)."""
    return cached(packed_tile_hash, positions, buckets, device)


@torch.library.custom_op("gbfunc::tile_hash", mutates_args=())
def tile_hash_op(positions: int, buckets: int, device: torch.device) -> Tensor:
    """`cached_tile_hash` as one opaque operation for traced code (`torch.compile`): traced,
    the hash's argsort and integer arithmetic would run in every compiled step. Returns a
    copy, so that the compiled code may reuse its memory without touching the cache. Packed,
    bucket and sign copy 4 bytes a position, not 12 (int64 and float32), and unpack inside
    the gather's kernel, which lowers a compiled step's peak (measured:
    `benchmarks/results/design_measurements.md`). A constant of the graph instead
    (`torch.compiler.assume_constant_result`) failed in torch 2.13's inductor for a plan of
    two hashed stacks ("ConstantSource(...) already in seen_sources")."""
    return cached_tile_hash(positions, buckets, device).clone()


@tile_hash_op.register_fake
def _(positions: int, buckets: int, device: torch.device) -> Tensor:
    return torch.empty(positions, dtype=torch.int32, device=device)


def _constant(make: Callable[..., Tensors], *args: Hashable) -> Tensors:
    """`make(*args)`, tensors fixed by the plan (the code tables), cached per arguments.

    Under `torch.compile` they are traced into the graph and recomputed by each call: a few
    small kernels for code tables (the hash, which is not small, is an opaque op instead).
    """
    if torch.compiler.is_compiling():
        return make(*args)
    return cached(make, *args)


def cached(make: Callable[..., Made], *args: Hashable) -> Made:
    """`make(*args)`, made once and kept, as plain tensors whatever the caller's state. Made
    inside a TorchDispatchMode, they are kept only where they are plain tensors: a
    FakeTensorMode's would enter every later call."""
    key = (make, *args)
    if (made := _MADE.get(key)) is not None:  # one lookup: another thread may clear between two
        return made
    made = _plain(make, *args)
    if all(type(t) is Tensor for t in ((made,) if isinstance(made, Tensor) else made)):
        if len(_MADE) >= 256:
            _MADE.clear()
        _MADE[key] = made
    return made


_MADE: dict[tuple, Tensor | Tensors] = {}


def _plain(make: Callable[..., Made], *args: Hashable) -> Made:
    # Outside any torch.func transform (made inside one, they would be its wrapped tensors),
    # outside inference mode (its tensors cannot be saved for a later backward), and on the
    # CPU unless `make` says where (under `with torch.device("meta")`, FSDP2's way to build a
    # model, the tables came out on meta: the loops then wrote through a null pointer).
    with torch._C._DisableFuncTorch(), torch.inference_mode(False), torch.device("cpu"):
        return make(*args)


def bucket_signs(positions: int, buckets: int, dtype: torch.dtype, device: torch.device) -> Tensors:
    """`hash_buckets` on `device`, the signs in `dtype`."""
    bucket, sign = hash_buckets(positions, buckets)
    return bucket.to(device), sign.to(dtype=dtype, device=device)


def packed_tile_hash(positions: int, buckets: int, device: torch.device) -> Tensor:
    """`hash_buckets` as one int32 tensor on `device`: `(bucket + 1) * sign`."""
    bucket, sign = hash_buckets(positions, buckets)
    return ((bucket + 1) * sign.long()).to(device=device, dtype=torch.int32)


def unpacked(packed: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The bucket (int64) and the sign (in `dtype`) of each position of a packed hash."""
    return (packed.abs() - 1).long(), packed.sign().to(dtype)


def gathered(table: Tensor, bucket: Tensor, sign: Tensor) -> Tensor:
    """`sign * table[:, bucket]`, `(T, P)`: each tile's buckets at its positions, signed."""
    # torch.gather, not index_select: its backward is a scatter_add, which inductor's CPU code
    # leaves to torch's kernel, where index_select's index_add becomes a scatter of atomic adds.
    return torch.gather(table, -1, bucket.expand(*table.shape[:-1], -1)) * sign


def signed_buckets(table: Tensor, packed: Tensor) -> Tensor:
    """Each tile's signed buckets, `(T, P)`: `sign(packed) * table[:, |packed| - 1]`.

    Shapes: table `(T, B)`, packed `(P,)` int32, no zero.
    """
    return gathered(table, *unpacked(packed, table.dtype))


def gradient_reference(grad: Tensor, packed: Tensor, buckets: int) -> Tensor:
    """`signed_buckets`'s gradient with respect to its table `(T, buckets)`, given `grad`
    `(T, ...)` with `P` values a tile: what the C loop `cpu._hash_gradient` computes."""
    grad = grad.reshape(grad.shape[0], -1)
    bucket, sign = unpacked(packed, grad.dtype)
    table = grad.new_zeros(grad.shape[0], buckets)
    return table.scatter_add(-1, bucket.expand(grad.shape[0], -1), grad * sign)


def hashed_tiles(stack: Stack, table: Tensor) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`: its signed
    buckets at the tile's positions, times `HASH_GAIN`."""
    hashed, dtype, device = stack.genome.hashed, table.dtype, table.device
    bucket, sign = cached(bucket_signs, stack.tile_positions, hashed, dtype, device)
    shared = gathered(table, bucket, sign * HASH_GAIN)
    return shared.reshape(table.shape[0], stack.tile[0], -1)


def per_tile(x: Tensor, counts: tuple[int, ...]) -> Tensor:
    """Repeat each g-net's row of `x` over its (consecutive) tiles: `(G, ...) -> (T, ...)`.

    Built from expands and one cat, so the backward is a sum per g-net; indexing would make
    it a scatter-add, which inductor's CPU code generation fails on (torch 2.13).
    """
    return torch.cat([x[g : g + 1].expand(n, *x.shape[1:]) for g, n in enumerate(counts)])


def tile_rows(x: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Tiles `lo:hi` of an optional per-tile tensor."""
    return None if x is None else x[lo:hi]
