"""A checksum of a tensor that does not depend on how the tensor is sharded.

A SHA-256 needs the whole tensor in one place; a DTensor saved by N ranks and read back by M
has no such place. This checksum adds up the tensor's bytes, each times a pseudo-random
weight drawn from its position in the whole tensor, modulo a prime, twice with different
weights: every rank sums its own shard and an all-reduce adds the parts, whatever the
layout. A changed, moved or lost byte changes it with probability about 1 - 2**-60. It
detects damage, not forgery: like the SHA-256 entries beside it, it is only as trustworthy
as the manifest that holds it.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

PRIME = 2**31 - 1
# (a0, a1, b1, a2, b2) of each of the two position hashes: odd constants below PRIME
_HASHES = (
    (1_103_515_245, 1_664_525_131, 12_345, 2_147_483_587, 1_013_904_223),
    (69_069_157, 1_234_567_891, 97_531, 1_597_334_677, 2_891_336_453 % PRIME),
)
_CHUNK = 1 << 20  # bytes summed at a time: bounds the int64 temporaries


def _weights(position: Tensor, hash_: tuple[int, ...]) -> Tensor:
    """A pseudo-random weight in `[0, PRIME)` for each byte position (int64)."""
    a0, a1, b1, a2, b2 = hash_
    h = ((position % PRIME) * a1 + (position // PRIME) * a0 + b1) % PRIME
    h = ((h * h) % PRIME * a2 + b2) % PRIME
    return (h * h + b1) % PRIME


def shard_sums(local: Tensor, offsets: Sequence[int], shape: Sequence[int]) -> Tensor:
    """The two sums, modulo `PRIME`, of `local`: the block of a tensor of global `shape` that
    starts at `offsets`. Shape `(2,)`, int64; add the parts of every shard, then reduce."""
    local = local.detach().contiguous().cpu()
    size = local.element_size()
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    data = local.reshape(-1).view(torch.uint8).reshape(-1, size)  # (elements, bytes each)
    sums = torch.zeros(2, dtype=torch.int64)
    per_chunk = max(1, _CHUNK // size)
    for lo in range(0, data.shape[0], per_chunk):
        index = torch.arange(lo, min(lo + per_chunk, data.shape[0]))  # local, row-major
        element = torch.zeros_like(index)  # its position in the whole tensor
        for d in range(local.dim() - 1, -1, -1):
            index, coordinate = index // local.shape[d], index % local.shape[d]
            element += (offsets[d] + coordinate) * strides[d]
        where = (element[:, None] * size + torch.arange(size)).reshape(-1)
        part = data[lo : lo + per_chunk].reshape(-1).to(torch.int64)
        for k, hash_ in enumerate(_HASHES):
            sums[k] += ((part * _weights(where, hash_)) % PRIME).sum() % PRIME
    return sums % PRIME


def checksum(t: Tensor) -> str:
    """`t`'s layout-free checksum, with its dtype and shape; for a DTensor a collective over
    its mesh."""
    if not isinstance(t, DTensor):
        return _hex(t, shard_sums(t, [0] * t.dim(), t.shape))
    mesh = t.device_mesh
    _, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    coordinate = mesh.get_coordinate()
    counted = all(  # a replicated copy is summed once: by the first rank along its mesh dim
        isinstance(p, Shard) or coordinate[d] == 0 for d, p in enumerate(t.placements)
    )
    sums = (
        shard_sums(t.to_local(), offsets, t.shape) if counted else torch.zeros(2, dtype=torch.int64)
    )
    for d in range(mesh.ndim):
        sums = sums.to(mesh.device_type)
        dist.all_reduce(sums, group=mesh.get_group(d))
        sums = sums.cpu() % PRIME
    return _hex(t, sums)


def _hex(t: Tensor, sums: Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}{list(t.shape)}:" + "-".join(f"{int(s):08x}" for s in sums)
