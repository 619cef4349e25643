"""An independent reference for gbfunc's generation, written from the definitions.

Nothing here comes from the library but its public types and the plan's data: position codes
(binary, Gray, Fourier, one-hot, grids), their standardisation, the activations, the g-net
MLP and tile-and-cut are written again, one position and one tile at a time, as plainly as
possible. A bug in the library's version of any of them shows up as a difference.
"""

import math

import torch
from torch import Tensor

from gbfunc import Generated, Plan, Stack


def bits_for(n: int) -> int:
    """Bits that label `n` positions: ceil(log2 n), at least 1."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def position_code(i: int, n: int, encoding: str, fourier_features: int) -> list[float]:
    """The code of position `i` of `n` along one axis."""
    if encoding == "fourier":
        u = (i + 0.5) / n
        angles = [u * (2.0**k) * math.pi for k in range(fourier_features)]
        return [math.sin(a) for a in angles] + [math.cos(a) for a in angles]
    value = i ^ (i >> 1) if encoding == "gray" else i  # the Gray code of i: i XOR (i >> 1)
    width = bits_for(n)
    return [float((value >> (width - 1 - b)) & 1) for b in range(width)]  # MSB first


def neuron_code(i: int, n: int, labels, encoding: str, fourier_features: int) -> list[float]:
    """The label of neuron `i` of `n`: its position, one-hot, or its cell on a grid."""
    if labels == "onehot":
        return [1.0 if j == i else 0.0 for j in range(n)]
    if labels == "position":
        return position_code(i, n, encoding, fourier_features)
    cell, rest = [], i
    for size in reversed(labels):  # row-major: the last coordinate varies fastest
        cell.append(rest % size)
        rest //= size
    coords = cell[::-1]
    return [
        bit
        for c, size in zip(coords, labels, strict=True)
        for bit in position_code(c, size, encoding, fourier_features)
    ]


def column_code(stack: Stack, q: int) -> list[float]:
    """The code of evaluation column `q` of a tile."""
    g = stack.genome
    taps = math.prod(stack.window)
    if taps > 1 and g.window_in == "code":  # column q is input column q // K at kernel tap q % K
        channel, tap = divmod(q, taps)
        code = neuron_code(channel, stack.tile[1], g.col_labels, g.encoding, g.fourier_features)
        index = []
        for size in reversed(stack.window):
            index.append(tap % size)
            tap //= size
        for d, size in zip(index[::-1], stack.window, strict=True):
            code += [1.0 if j == d else 0.0 for j in range(size)]
        return code
    return neuron_code(q, stack.columns, g.col_labels, g.encoding, g.fourier_features)


def input_codes(stack: Stack) -> Tensor:
    """`(TH, Q, R + C)` g-net inputs of a tile, standardised by one scalar mean and std."""
    g = stack.genome
    th = stack.tile[0]
    rows = [neuron_code(i, th, g.row_labels, g.encoding, g.fourier_features) for i in range(th)]
    cols = [column_code(stack, q) for q in range(stack.columns)]
    full = torch.tensor([[r + c for c in cols] for r in rows], dtype=torch.float64)
    mean = full.mean()
    std = full.std(unbiased=False).clamp_min(1e-6)
    return (full - mean) / std


def activate(z: Tensor, name: str) -> Tensor:
    """The activations, from their formulas."""
    if name == "relu":
        return torch.where(z <= 0, torch.zeros_like(z), z)  # a NaN stays NaN
    if name == "gelu":
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    if name == "tanh":
        return (torch.exp(z) - torch.exp(-z)) / (torch.exp(z) + torch.exp(-z))
    if name == "silu":
        return z / (1 + torch.exp(-z))
    raise ValueError(name)


def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finaliser, in Python integers."""
    x &= 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def hash_slots(positions: int, buckets: int) -> list[tuple[int, float]]:
    """(bucket, sign) of each position of a tile: buckets by rank of the hashed index."""
    order = sorted(range(positions), key=fmix32)
    rank = {n: r for r, n in enumerate(order)}
    return [(rank[n] % buckets, 1.0 if fmix32(n | 1 << 31) & 1 else -1.0) for n in range(positions)]


def naive_apply(gparams: dict, plan: Plan, condition: Tensor | None = None) -> dict[str, Tensor]:
    """Every parameter of the p-net: g-nets run tile by tile, tiles placed by explicit copies.
    A conditioned g-net adds `condition @ w_cond` to its first layer's pre-activation."""
    out = {}
    for p in plan.params:
        if not isinstance(p, Generated):
            out[p.name] = gparams["free" if p.trainable else "frozen"][p.name]
            continue
        stack = plan.stacks[p.stack_index]
        leaves = {k: v.double() for k, v in gparams["stacks"][stack.key].items()}
        th, tw = stack.tile
        taps = math.prod(stack.window)
        codes = input_codes(stack)
        owner = [g for g, n in enumerate(stack.tiles_per_gnet) for _ in range(n)]
        blocks = []
        for block in p.blocks:
            full = torch.zeros(block.grid[0] * th, block.grid[1] * tw, taps, dtype=torch.float64)
            for k in range(block.num_tiles):
                t = block.first_tile + k
                g = owner[t]
                h = codes @ leaves["w_in"][g] + leaves["b_in"][g]
                if stack.genome.share:
                    h = h + leaves["tile_embed"][t] @ leaves["w_embed"][g]
                if stack.genome.condition:
                    h = h + condition.double() @ leaves["w_cond"][g]
                h = activate(h, stack.genome.activation)
                for layer in range(stack.genome.depth - 1):
                    h = h @ leaves["w_hidden"][g, layer] + leaves["b_hidden"][g, layer]
                    h = activate(h, stack.genome.activation)
                y = (h @ leaves["w_out"][g] + leaves["b_out"][g]).reshape(th, tw, taps)
                if stack.genome.hashed:
                    slots = hash_slots(th * tw * taps, stack.genome.hashed)
                    for n, (bucket, sign) in enumerate(slots):
                        i, rest = divmod(n, tw * taps)
                        # The table is stored divided by its gain, 10.
                        y[i, rest // taps, rest % taps] += (
                            10 * sign * leaves["tile_hash"][t, bucket]
                        )
                r, c = divmod(k, block.grid[1])
                for i in range(th):
                    for j in range(tw):
                        full[r * th + i, c * tw + j] = y[i, j]
            blocks.append(full[: block.rows, : block.cols])
        weight = torch.cat(blocks, dim=p.split_dim) if len(blocks) > 1 else blocks[0]
        weight = weight.reshape(p.shape)
        if p.center:
            weight = weight - weight.reshape(len(weight), -1).mean(1).reshape(
                -1, *[1] * (weight.dim() - 1)
            )
        out[p.name] = (weight * p.scale).to(gparams["stacks"][stack.key]["w_in"].dtype)
    return out
