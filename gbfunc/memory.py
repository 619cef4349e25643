"""Measure what autograd keeps for backward (`gb.memory.saved_bytes`)."""

from collections.abc import Callable, Hashable, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of distinct tensor storage autograd saves for backward while `fn()` runs.

    A sparse tensor (COO or compressed: CSR, CSC, BSR, BSC) counts its indices' and values'
    storage, a nested one its buffers', a wrapper subclass (a `DTensor`'s local shard,
    `__tensor_flatten__`) its inner tensors'; a tensor with no storage to read (another
    subclass without one) counts its elements. `fn` may
    not run `torch.func` transforms: they do not take autograd's saved-tensor hooks.

    Examples:
        >>> x = torch.randn(1000, requires_grad=True)
        >>> gb.memory.saved_bytes(lambda: x.exp())  # exp saves its output
        4000
    """
    if not callable(fn):
        raise TypeError(
            f"gb.memory.saved_bytes: fn must be a callable that runs the computation (say "
            f"lambda: x.exp()), got {type(fn).__name__}; a result is computed already."
        )
    storages: dict[Hashable, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storages.update(_storages(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _storages(t: torch.Tensor) -> Iterator[tuple[Hashable, int]]:
    """`(key, bytes)` of each storage holding `t`'s values; equal keys share one storage."""
    if t.is_sparse:
        yield from (s for part in (t._indices(), t._values()) for s in _storages(part))
    elif t.layout in _COMPRESSED:
        by_rows = t.layout in (torch.sparse_csr, torch.sparse_bsr)
        index = (
            (t.crow_indices(), t.col_indices()) if by_rows else (t.ccol_indices(), t.row_indices())
        )
        yield from (s for part in (*index, t.values()) for s in _storages(part))
    elif t.is_nested:
        parts = [t.values(), t.offsets()] if t.layout == torch.jagged else [t.values()]
        yield from (s for part in parts if part is not None for s in _storages(part))
    elif is_traceable_wrapper_subclass(t):  # its storage is its inner tensors'
        names, _ = t.__tensor_flatten__()
        yield from (s for name in names for s in _storages(getattr(t, name)))
    else:
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device.type, t.device.index or 0)
        except (RuntimeError, NotImplementedError):  # a subclass with no storage of its own
            yield ("tensor", id(t)), t.nelement() * t.element_size()
            return
        yield key, storage.nbytes()
