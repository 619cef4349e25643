"""The p-net's buffers that a checkpoint holds: those its `state_dict` holds."""

from torch import Tensor, nn


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """`model`'s buffers that its `state_dict` holds (tied ones once), by name."""
    return {name: buf for name, buf in model.named_buffers() if is_persistent(model, name)}


def is_persistent(model: nn.Module, name: str) -> bool:
    """Whether `model`'s buffer `name` (dotted) is one its `state_dict` holds."""
    owner, _, local = name.rpartition(".")
    return local not in model.get_submodule(owner)._non_persistent_buffers_set
