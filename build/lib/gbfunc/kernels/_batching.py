"""Shared piece of the ops' vmap rules: the launchers take any leading batch shape."""

from torch import Tensor


def batch_first(
    size: int, tensors: tuple[Tensor | None, ...], in_dims: tuple[int | None, ...]
) -> list[Tensor | None]:
    """Move each vmapped dim to the front; broadcast tensors vmap left unbatched to `size`.

    Broadcasting is a stride-0 view; the ops make it contiguous before launching, which
    copies only g-net-sized tensors, never weights.
    """
    return [
        None if x is None else x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
        for x, dim in zip(tensors, in_dims, strict=True)
    ]
