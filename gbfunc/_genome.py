"""The g-net architecture (the *genome*) and the position codes it reads.

Axis letters used in comments across gbfunc:
    T tiles of a stack, G g-nets of a stack (G == T unless g-nets are shared),
    TH x TW a tile in matrix units, K kernel positions folded into the columns,
    Q evaluation columns of a tile (Q * P == TW * K), P values emitted per evaluation,
    R / C row / column code widths, H hidden width, E tile-embedding width.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ._numbers import as_integer, integer

ACTIVATIONS = ("relu", "gelu", "tanh", "silu")
ENCODINGS = ("binary", "gray", "fourier")
# Frequencies 2^k pi, k < fourier_features: past 2^52 a float64 position times the frequency
# is a whole multiple of pi, each feature the same at every position (and 2^1024 overflows).
MAX_FOURIER_FEATURES = 52
WINDOW_MODES = ("code", "output")
# How the neurons along a weight axis are labelled: "position" codes the tile-local index with
# the genome's `encoding`; "onehot" gives each neuron its own input (e.g. output classes); a
# tuple of sizes reads the index as a row-major position on that grid (e.g. `(8, 8)` for the
# pixels of an 8x8 image) and codes each coordinate with `encoding`.
Labels = str | tuple[int, ...]
LABEL_KINDS = ("position", "onehot")
# `hashed=AUTO` in `gb.plan`: the tables' sizes are chosen to reach its `compression=`.
AUTO = "auto"


@dataclass(frozen=True)
class Genome:
    """Architecture of one g-net: an MLP from a position's code to `outputs` weights.

    The default is torchGB's genome: standardised binary codes of the tile-local row and
    column, one hidden layer of 32 ReLU units, one scalar per position, one g-net per tile.

    Attributes:
        hidden: Width of every hidden layer.
        depth: Number of hidden layers (>= 1).
        activation: One of `ACTIVATIONS`.
        encoding: Position code: `"binary"` (torchGB), `"gray"` (Shuvaev et al. 2024) or
            `"fourier"` (sin/cos features).
        fourier_features: Frequencies per axis for `encoding="fourier"`.
        outputs: Weights emitted per evaluation along a row (linear-like weights only). With
            `outputs=P` a tile costs `TH * TW / P` hidden activations and a small matmul.
        window_in: Where a convolution's kernel window goes: in the `"code"` (one-hot
            inputs, torchGB) or in the `"output"` (one evaluation emits all `K` kernel taps).
        share: One g-net per parameter, shared by all its tiles, each tile adding a learned
            embedding to the first layer (much higher compression).
        embed_dim: Width of the per-tile embedding when `share=True`.
        row_labels, col_labels: Labels of the neurons along the rows (outputs) and columns
            (inputs) of a weight: `"position"`, `"onehot"` or a grid shape, see `Labels`.
            Anything but `"position"` needs the axis to be a single tile (`tile="full"`),
            so that labels name neurons, as in Shuvaev et al. 2024.
        hashed: Buckets of a per-tile table of weights shared by hashing (HashedNets, Chen
            et al. 2015), added to the g-net's output: every position of a tile adds
            `sign * table[bucket]`, bucket and sign fixed by the position (`hash_buckets`).
            The table starts random with the tile's variance and the g-nets at zero output,
            so the model starts as HashedNets; the g-nets learn what the sharing misses. The
            table is stored divided by 10, so that one learning rate suits both. 0: no table.
            `gb.plan` also takes `"auto"`: tables sized to reach its `compression=`.
        condition: Width of a condition vector (a task's embedding, or features of an input)
            that every g-net reads in its first layer, `w_cond` mapping it to a shift of the
            first layer's bias shared by all of a g-net's tiles. `w_cond` starts at zero, so
            every condition starts from the same weights. 0: no condition.
    """

    hidden: int = 32
    depth: int = 1
    activation: str = "relu"
    encoding: str = "binary"
    fourier_features: int = 4
    outputs: int = 1
    window_in: str = "code"
    share: bool = False
    embed_dim: int = 8
    row_labels: Labels = "position"
    col_labels: Labels = "position"
    hashed: int = 0
    condition: int = 0

    def __post_init__(self) -> None:
        checked = check_genome({f.name: getattr(self, f.name) for f in fields(self)}, "gb.Genome")
        for name, value in checked.items():  # numbers as Python ints, grid labels as tuples
            object.__setattr__(self, name, value)
        if self.hashed == AUTO:
            raise ValueError(
                "gb.Genome: hashed='auto' is for gb.plan(..., compression=...), which sizes the "
                "tables; a Genome takes a number of buckets."
            )

    def param_shapes(self, code_width: int, outputs: int) -> dict[str, tuple[int, ...]]:
        """Shapes of one g-net's parameters, by leaf name (no stacking axis)."""
        h = self.hidden
        shapes: dict[str, tuple[int, ...]] = {"w_in": (code_width, h), "b_in": (h,)}
        if self.depth > 1:
            shapes["w_hidden"] = (self.depth - 1, h, h)
            shapes["b_hidden"] = (self.depth - 1, h)
        shapes["w_out"] = (h, outputs)
        shapes["b_out"] = (outputs,)
        if self.share:
            shapes["w_embed"] = (self.embed_dim, h)
        if self.condition:
            shapes["w_cond"] = (self.condition, h)
        return shapes

    def param_count(self, code_width: int, outputs: int) -> int:
        """Parameters of one g-net (tile embeddings not included)."""
        return sum(math.prod(s) for s in self.param_shapes(code_width, outputs).values())


def check_genome(
    options: Mapping[str, object], where: str, label: Callable[[str], str] = str
) -> dict[str, object]:
    """`options` with its numbers as Python ints and grid labels as tuples of them; raises,
    naming the call and the option, unless `options` are valid `Genome` fields.

    Args:
        options: `{field: value}` for some of `Genome`'s fields; other keys are kept as given.
        where: The call that received them, e.g. `"gb.plan"`.
        label: How an option is named in messages, e.g. `lambda n: f"overrides['x'][{n!r}]"`.
    """
    checked = dict(options)
    for name in ("hidden", "depth", "fourier_features", "outputs", "embed_dim"):
        if name in options:
            most = MAX_FOURIER_FEATURES if name == "fourier_features" else None
            checked[name] = integer(where, label(name), options[name], minimum=1, maximum=most)
    if "condition" in options:
        checked["condition"] = integer(where, label("condition"), options["condition"], minimum=0)
    if "hashed" in options and options["hashed"] != AUTO:
        checked["hashed"] = integer(where, label("hashed"), options["hashed"], minimum=0)
    for name, choices in (
        ("activation", ACTIVATIONS),
        ("encoding", ENCODINGS),
        ("window_in", WINDOW_MODES),
    ):
        if name in options and options[name] not in choices:
            raise ValueError(
                f"{where}: {label(name)} must be one of {choices}, got {options[name]!r}."
            )
    if "share" in options and not isinstance(options["share"], bool):
        raise TypeError(f"{where}: {label('share')} must be a bool, got {options['share']!r}.")
    for name in ("row_labels", "col_labels"):
        labels = options.get(name, "position")
        if isinstance(labels, str) and labels in LABEL_KINDS:
            continue
        grid = tuple(map(as_integer, labels)) if isinstance(labels, tuple | list) else ()
        if not grid or not all(d is not None and d > 0 for d in grid):
            raise ValueError(
                f"{where}: {label(name)} must be one of {LABEL_KINDS} or a grid shape such as "
                f"(8, 8), got {labels!r}."
            )
        checked[name] = grid
    return checked


def bits(n: int) -> int:
    """Number of bits that label `n` positions (at least 1)."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def axis_code(n: int, encoding: str, fourier_features: int) -> Tensor:
    """Code of positions `0..n-1` along one tile axis, shape `(n, width)`, unstandardised."""
    idx = torch.arange(n, dtype=torch.int64)
    if encoding == "fourier":
        u = (idx.double() + 0.5) / n
        freq = (2.0 ** torch.arange(fourier_features, dtype=torch.float64)) * math.pi
        angles = u[:, None] * freq[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if encoding == "gray":
        idx = idx ^ (idx >> 1)
    shifts = torch.arange(bits(n) - 1, -1, -1, dtype=torch.int64)  # most significant bit first
    return ((idx[:, None] >> shifts[None, :]) & 1).double()


def labels_width(n: int, labels: Labels, encoding: str, fourier_features: int) -> int:
    """Width of the code of `n` neurons labelled by `labels`."""
    if labels == "onehot":
        return n
    dims = (n,) if labels == "position" else labels
    return sum(2 * fourier_features if encoding == "fourier" else bits(d) for d in dims)


def labels_code(n: int, labels: Labels, encoding: str, fourier_features: int) -> Tensor:
    """Code of neurons `0..n-1` labelled by `labels`, shape `(n, width)`, unstandardised."""
    if labels == "onehot":
        return torch.eye(n, dtype=torch.float64)
    if labels == "position":
        return axis_code(n, encoding, fourier_features)
    if math.prod(labels) != n:
        raise ValueError(f"labels: grid {labels} has {math.prod(labels)} cells for {n} neurons.")
    idx = torch.arange(n)
    parts = []
    for d in reversed(labels):  # row-major: the last coordinate varies fastest
        parts.append(axis_code(d, encoding, fourier_features)[idx % d])
        idx = idx // d
    return torch.cat(parts[::-1], dim=1)


def hash_buckets(positions: int, buckets: int) -> tuple[Tensor, Tensor]:
    """Bucket `(positions,)` int64 and sign `(positions,)` float64 of each position of a tile.

    Positions are ranked by MurmurHash3's 32-bit finaliser of their index, and the rank modulo
    `buckets` is the bucket, so buckets differ in size by at most one; the sign is the low bit
    of the finaliser of the index with the top bit set. Pure integer arithmetic: the same on
    every machine and torch version, so a saved table keeps its meaning.
    """
    idx = torch.arange(positions, dtype=torch.int64)
    rank = torch.empty_like(idx)
    rank[torch.argsort(_fmix32(idx))] = idx
    sign = (_fmix32(idx | (1 << 31)) & 1).double() * 2 - 1
    return rank % buckets, sign


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's finaliser: a bijection on 32-bit integers (held in int64)."""
    x = x & 0xFFFFFFFF
    x = _mul32(x ^ (x >> 16), 0x85EBCA6B)
    x = _mul32(x ^ (x >> 13), 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x: Tensor, c: int) -> Tensor:
    """`x * c` modulo 2**32, in halves of `c` so that no int64 product overflows."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


def kernel_code(window: tuple[int, ...]) -> Tensor:
    """One-hot code of every kernel tap (row-major), shape `(prod(window), sum(window))`."""
    taps = torch.cartesian_prod(*[torch.arange(k) for k in window]).reshape(-1, len(window))
    # Compared with each class, not `F.one_hot`: torch 2.11's one_hot does not trace under
    # `torch.compile` on CUDA (it checks the values, a data-dependent branch).
    return torch.cat(
        [(taps[:, d, None] == torch.arange(k)).double() for d, k in enumerate(window)], dim=1
    )


def standardise(row_code: Tensor, col_code: Tensor) -> tuple[Tensor, Tensor]:
    """Standardise both code tables with one scalar mean and std, as torchGB does.

    The statistics are those of the full `(TH * Q, R + C)` input matrix, computed from the
    two factors without building it.
    """
    width = row_code.shape[1] + col_code.shape[1]
    mean = (row_code.mean(0).sum() + col_code.mean(0).sum()) / width
    second = ((row_code**2).mean(0).sum() + (col_code**2).mean(0).sum()) / width
    std = (second - mean**2).clamp_min(1e-12).sqrt()
    return (row_code - mean) / std, (col_code - mean) / std


def stack_codes(
    tile: tuple[int, int],
    window: tuple[int, ...],
    genome: Genome,
    columns: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> tuple[Tensor, Tensor]:
    """Standardised row codes `(TH, R)` and column codes `(Q, C)` of a stack's tile.

    Column `q` of a tile is tile-local column `q` (matrices), column `q // K` at kernel tap
    `q % K` (conv kernels in the code), or column `q` emitting all `K` taps (in the output).
    """
    th, tw = tile
    ff = genome.fourier_features
    row = labels_code(th, genome.row_labels, genome.encoding, ff)
    taps = math.prod(window)
    if taps > 1 and genome.window_in == "code":
        per_col = labels_code(tw, genome.col_labels, genome.encoding, ff)
        taps_code = kernel_code(window)
        col = torch.cat(
            [per_col.repeat_interleave(taps, 0), taps_code.repeat(tw, 1)], dim=1
        )  # (TW * K, C): column-major over (tw, tap)
    else:
        col = labels_code(columns, genome.col_labels, genome.encoding, ff)
    row, col = standardise(row, col)
    return row.to(dtype=dtype, device=device), col.to(dtype=dtype, device=device)
