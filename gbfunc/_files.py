"""Atomic file writes and tensors that safetensors accepts."""

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable

import torch
from torch import Tensor


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """Make `path` appear whole or not at all: `write(tmp)`, fsync, then rename over `path`.

    The temporary file sits in the same directory (a rename is atomic only within one file
    system). A crash at any point leaves the previous `path` untouched; at worst a stale
    `.NAME.*.tmp` file remains beside it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)  # an existing file keeps its mode
    except FileNotFoundError:
        mode = 0o666 & ~_umask()  # a new one follows the umask, as open() would
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if os.name == "posix":  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    """The process's umask (reading it means setting it; it is put straight back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def standalone(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors, each owning its whole storage.

    safetensors refuses tensors that share memory (tied weights, views); those are cloned.
    """
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        whole = storage.nbytes() == t.numel() * t.element_size()
        if storage.data_ptr() in seen or not whole:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def check_no_meta(tensors: dict[str, Tensor], where: str) -> None:
    """Raise `ValueError` for the first tensor on the `meta` device (it has no values).

    Args:
        tensors: `{label: tensor}`; the label names the tensor in the message.
        where: Prefix of the message, e.g. `"gb.save"`.
    """
    for label, t in tensors.items():
        if t.device == torch.device("meta"):
            raise ValueError(f"{where}: {label} is on the meta device: it has no values to write.")
