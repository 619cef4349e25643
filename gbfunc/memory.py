"""Measure what autograd keeps for backward (`gb.memory.saved_bytes`)."""

from collections.abc import Callable

import torch


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of distinct tensor storage autograd saves for backward while `fn()` runs.

    Examples:
        >>> x = torch.randn(1000, requires_grad=True)
        >>> gb.memory.saved_bytes(lambda: x.exp())  # exp saves its output
        4000
    """
    storages: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages[(storage.data_ptr(), t.device.index or 0)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
