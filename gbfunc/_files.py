"""Atomic file writes and tensors that safetensors accepts."""

import contextlib
import errno
import functools
import os
import secrets
import stat
from collections.abc import Callable

import safetensors
import safetensors.torch
import torch
from torch import Tensor


def write_atomic(path: str, write: Callable[[str], None]) -> str:
    """Make `path` appear whole or not at all: `write(tmp)`, fsync, then rename over `path`.
    Returns the path written: `path` with its symbolic links resolved, so that a link keeps
    pointing at the file it named, which is the one replaced.

    The temporary file sits in the same directory (a rename is atomic only within one file
    system). A new file gets the mode the umask gives (as `open` would); an existing file
    keeps its mode (a read-only one too: the temporary file is its owner's to write until the
    rename), and the temporary file never grants others more than either. Anything but a
    regular file at `path` (a directory, a FIFO, a device) is refused before anything is
    written (`OSError`): a rename would put a file in a device's place. A crash at any point
    leaves the previous `path` untouched; at worst a stale `.NAME.*.tmp` file remains beside
    it. The caller then syncs the directory (`sync_dir`), which makes the rename durable: not
    done here, so that an error raised here always means that `path` was not replaced.
    """
    path = os.path.realpath(path)
    directory = os.path.dirname(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        keep: int | None = None
    else:
        if not stat.S_ISREG(info.st_mode):
            kind = FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a file")
            raise OSError(errno.EINVAL, f"not a regular file but {kind}")
        keep = stat.S_IMODE(info.st_mode)
    wanted = 0o666 if keep is None else keep | stat.S_IRUSR | stat.S_IWUSR
    tmp, mode = _create_temp(directory, os.path.basename(path), wanted)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode if keep is None else keep)  # `write` may replace the file (safetensors)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


FILE_KINDS = {  # what `stat.S_IFMT` gives, in words, for all but a regular file
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def sync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory, which makes the entries created or renamed in it durable (POSIX)."""
    if os.name == "posix":
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _create_temp(directory: str, name: str, mode: int) -> tuple[str, int]:
    """Create an empty `.NAME.*.tmp` in `directory` with `mode` less the umask (as `open` does).

    Returns its path and the mode it got, read back so the umask is never set to be read.
    """
    short = name  # cut to 200 bytes, so that the temporary name fits where `name` does
    while len(os.fsencode(short)) > 200:
        short = short[:-1]
    for _ in range(100):
        tmp = os.path.join(directory, f".{short}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue
        try:
            return tmp, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(f"no free temporary file name for {name} in {directory}")


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


def check_readable_back(labelled: dict[str, Tensor]) -> None:
    """Raise `TypeError` for the first tensor in a dtype that safetensors writes but cannot
    read back (e.g. `float8_e8m0fnu` with safetensors 0.8) or cannot write at all
    (`complex128`): the file would replace a good one and then be refused as damaged.

    Args:
        labelled: `{label: tensor}`; the label begins the message (e.g. "gb.save: entry 'x'").
    """
    for label, t in labelled.items():
        if not _readable_back(t.dtype):
            raise TypeError(
                f"{label} is {t.dtype}, which safetensors {safetensors.__version__} cannot "
                "store and read back; nothing was written. Store it reinterpreted (e.g. "
                ".view(torch.uint8)), or leave it out."
            )


@functools.cache
def _readable_back(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` survives a safetensors write and read unchanged in dtype."""
    try:
        data = safetensors.torch.save({"x": torch.zeros(1, dtype=dtype)})
        return safetensors.torch.load(data)["x"].dtype == dtype
    except Exception:  # safetensors raises its own types, and KeyError for unknown dtypes
        return False


def check_no_meta(tensors: dict[str, Tensor], where: str, remedy: str = "") -> None:
    """Raise `ValueError` for the first tensor on the `meta` device (it has no values).

    Args:
        tensors: `{label: tensor}`; the label names the tensor in the message.
        where: Prefix of the message, e.g. `"gb.save"`.
        remedy: A sentence that ends the message: what to pass instead.
    """
    for label, t in tensors.items():
        if t.device == torch.device("meta"):
            message = f"{where}: {label} is on the meta device: it has no values to write."
            raise ValueError(f"{message} {remedy}".rstrip())
