"""Data for data-parallel ranks: the caller speaks in global batches, each rank gets its shard."""

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .._numbers import integer
from ._mesh import dim_rank, dim_size


def local_batch_size(global_batch_size: int, mesh: DeviceMesh, where: str) -> int:
    """Rows per data-parallel rank; raises unless `global_batch_size` splits evenly."""
    global_batch_size = integer(where, "global_batch_size", global_batch_size, minimum=1)
    dp = dim_size(mesh, "dp", where)
    if global_batch_size % dp:
        raise ValueError(
            f"{where}: global_batch_size {global_batch_size} is not divisible by the {dp} "
            "data-parallel ranks; use a multiple of the dp size."
        )
    return global_batch_size // dp


def shard_batch(batch: Tensor | Sequence[Tensor], mesh: DeviceMesh) -> Tensor | tuple[Tensor, ...]:
    """This data-parallel rank's rows of a global batch (dim 0), the same on every tp/pp rank.

    Args:
        batch: A tensor or a sequence of tensors sharing dim 0 (inputs, targets, ...).
        mesh: From `init_mesh`.

    Examples:
        64 rows on 4 data-parallel ranks: 16 each.

        >>> x, y = gb.dist.shard_batch((x, y), mesh)  # doctest: +SKIP
    """
    tensors = (batch,) if isinstance(batch, Tensor) else tuple(batch)
    if not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        raise TypeError(
            "gb.dist.shard_batch: batch must be a tensor or a sequence of tensors with a "
            f"batch dim (dim 0), got {batch!r:.100}."
        )
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise ValueError(
            f"gb.dist.shard_batch: tensors in batch have different dim-0 sizes {sorted(rows)}."
        )
    size = local_batch_size(rows.pop(), mesh, "gb.dist.shard_batch")
    start = dim_rank(mesh, "dp", "gb.dist.shard_batch") * size
    out = tuple(t[start : start + size] for t in tensors)
    return out[0] if isinstance(batch, Tensor) else out


def data_loader(
    dataset: Dataset,
    global_batch_size: int,
    mesh: DeviceMesh,
    *,
    shuffle: bool = True,
    seed: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A `DataLoader` yielding this data-parallel rank's share of each global batch.

    Ranks with the same dp coordinate (tensor or pipeline peers) get the same samples. Call
    `loader.sampler.set_epoch(epoch)` each epoch to reshuffle.

    Args:
        dataset: A map-style dataset.
        global_batch_size: Samples per step across all data-parallel ranks.
        mesh: From `init_mesh`.
        shuffle: Shuffle (identically seeded on every rank).
        seed: Shuffle seed.
        **kwargs: Passed to `DataLoader` (`num_workers`, `collate_fn`, ...).

    Examples:
        >>> loader = gb.dist.data_loader(  # doctest: +SKIP
        ...     dataset, global_batch_size=64, mesh=mesh
        ... )
    """
    size = local_batch_size(global_batch_size, mesh, "gb.dist.data_loader")
    seed = integer("gb.dist.data_loader", "seed", seed)
    sampler = DistributedSampler(
        dataset,
        num_replicas=dim_size(mesh, "dp", "gb.dist.data_loader"),
        rank=dim_rank(mesh, "dp", "gb.dist.data_loader"),
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
    )
    return DataLoader(dataset, batch_size=size, sampler=sampler, drop_last=True, **kwargs)
