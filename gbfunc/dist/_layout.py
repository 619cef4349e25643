"""Where a sharded checkpoint's files lie in its directory (and which DCP file holds an entry),
and how a save replaces them.

The directory holds the manifest (`gbfunc.json`) and, in a subfolder the manifest names
(`"data": "shards-<hex>"`), DCP's files. A save writes a new subfolder beside the current
one, and rank 0 then replaces the manifest in one `os.replace`: before that rename the
previous manifest and its subfolder are untouched, after it the new ones are complete, so a
save that fails or is killed at any point leaves a loadable checkpoint, the old or the new.
Nothing is renamed but the manifest (the directory may be a mount point; other files in it
are left alone), and only rank 0 writes it, once every rank's files are written: the ranks
agree on the new subfolder's name and nothing else. After the switch rank 0 syncs the
directory, which makes the rename durable, then removes the replaced subfolder, any left by
killed saves, and, where the replaced manifest was from before format 5, the DCP files that
lay beside it (DCP files there beside a later manifest are the user's). A failure after the
rename is no failure of the save: the new checkpoint is complete, and what it replaced stays
until the next save.

Saves and loads of one directory may overlap (two jobs, an evaluation polling a training
run's checkpoint): each holds a shared lock on the directory's `.gbfunc.lock` while it
writes or reads (`sharing`), and a save removes folders only under the exclusive lock, so
only when nothing else is under way, keeping the folder the manifest names then (another
save may have replaced its own since). Where the file system takes no lock, saves and loads
do not wait for one (as before the lock existed).
"""

import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: saves and loads take no lock
    fcntl = None

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from .._checkpoint import CheckpointCorruptError, CheckpointError, checkpoint_path
from .._files import sync_dir, write_atomic

MANIFEST = "gbfunc.json"
LOCK = ".gbfunc.lock"
FIRST_WITH_FOLDER = 5  # the first format version whose manifest names its data subfolder
_FOLDER = re.compile(r"shards-[0-9a-f]{16}")
# beside the manifest: a temporary manifest of a `write_atomic` killed before its rename
# (always a save's), and DCP's files (a replaced checkpoint's only where its format was < 5)
_LEFTOVER = re.compile(r"\.gbfunc\.json\.[0-9a-f]+\.tmp")
_LEGACY = re.compile(r"\.metadata|__\d+_\d+\.distcp")


def target(path: object, where: str) -> Path:
    """`path` as a directory a save can write, or a `CheckpointError` naming it."""
    text = checkpoint_path(path, where)
    if os.path.lexists(text) and not os.path.isdir(text):
        raise CheckpointError(
            f"{where}: {text}: is a file, not a directory; a sharded checkpoint is a folder "
            "(gb.save writes single files). Pass a directory path."
        )
    return Path(text)


def new_folder() -> str:
    """A fresh name for a save's data subfolder (rank 0 draws it; every rank writes into it)."""
    return f"shards-{secrets.token_hex(8)}"


def data_folder(path: Path, manifest: dict[str, Any], where: str) -> Path:
    """The folder holding the DCP files of the checkpoint whose manifest is `manifest`."""
    name = manifest.get("data")
    if name is None and manifest["format_version"] < FIRST_WITH_FOLDER:
        return path  # DCP's files beside the manifest
    if not isinstance(name, str) or not _FOLDER.fullmatch(name):
        raise CheckpointCorruptError(f"{where}: {MANIFEST} names no data folder ({name!r:.80}).")
    return path / name


@contextmanager
def sharing(path: object, saving: bool = False) -> Iterator[int | None]:
    """Hold a shared lock on the checkpoint directory `path` while a save writes
    (`saving`: it creates the directory and the lock file) or a load reads there; yields its
    descriptor (None: no lock, where there is no lock file to read, the directory is
    read-only, or its file system takes none)."""
    fd = None
    if fcntl is not None:
        with suppress(OSError, TypeError):
            if saving:
                os.makedirs(path, exist_ok=True)  # as DCP would: the lock file goes in it
            flags = os.O_RDWR | os.O_CREAT if saving else os.O_RDONLY
            fd = os.open(os.path.join(path, LOCK), flags, 0o644)
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:  # a file system that takes no lock: none held, none asked
                os.close(fd)
                fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)  # and with it the lock


def _alone(fd: int | None) -> bool:
    """Whether the shared lock `fd` (`sharing`'s) became exclusive: no other save or load
    of the directory is under way. Without a lock, True (as before there was one)."""
    if fd is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def publish(path: Path, folder: str, manifest: str, lock: int | None = None) -> str | None:
    """Switch the checkpoint at `path` to the complete subfolder `folder`: write its
    `manifest` (JSON text) atomically, then remove what it replaced, where nothing else holds
    the directory's lock (`lock`: this save's, from `sharing`).

    Raises `OSError` only where the manifest was not replaced. Returns None, or what failed
    after the switch, in words: the new checkpoint is loadable all the same.
    """
    sync_dir(path / folder)  # its entries are durable before the manifest names them
    legacy = _version(path / MANIFEST) < FIRST_WITH_FOLDER
    write_atomic(os.fspath(path / MANIFEST), lambda tmp: Path(tmp).write_text(manifest))
    try:  # until the rename is durable, a crash may bring back the manifest it replaced
        sync_dir(path)
    except OSError as e:
        return f"the directory could not be synced ({reason(e)})"
    if not _alone(lock):  # another save or a load is under way: the next save cleans up
        return None
    with suppress(OSError, ValueError, AttributeError):  # kept: the folder named now
        folder = json.loads((path / MANIFEST).read_text()).get("data", folder)
    try:  # best effort: what stays is removed by the next save
        for entry in os.scandir(path):
            if _FOLDER.fullmatch(entry.name) and entry.name != folder:
                shutil.rmtree(entry.path, ignore_errors=True)
            elif (
                _LEFTOVER.fullmatch(entry.name) or (legacy and _LEGACY.fullmatch(entry.name))
            ) and entry.is_file(follow_symlinks=False):
                with suppress(OSError):
                    os.unlink(entry.path)
    except OSError as e:
        return f"what it replaced could not be removed ({reason(e)})"
    return None


def _version(manifest: Path) -> float:
    """The format version of the sharded checkpoint's `manifest`; infinity where there is
    none or it cannot be read (nothing beside it is then taken for the checkpoint's)."""
    try:
        version = json.loads(manifest.read_text()).get("format_version")
    except (OSError, ValueError, AttributeError):
        return math.inf
    return version if isinstance(version, int) and not isinstance(version, bool) else math.inf


def discard(path: Path, folder: str) -> None:
    """Remove the subfolder of a save that failed (best effort)."""
    shutil.rmtree(path / folder, ignore_errors=True)


def reason(error: BaseException) -> str:
    """What went wrong, in a few words: an OS error's text, or the first failure that DCP's
    `CheckpointException` (a `BaseException`, whose text is a traceback) wraps."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = next(iter(error.failures.items()))
        return f"rank {rank}: {reason(error)}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    return f"{error!s:.300}" or type(error).__name__


def entry_file(path: Path, key: str) -> str:
    """The DCP data file holding entry `key` (for messages)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        for index, info in metadata.storage_data.items():
            if index.fqn == key:
                return str(path / info.relative_path)
    except Exception:  # the message still names the entry
        pass
    return str(path)


def short_data_file(path: Path) -> str | None:
    """The first DCP data file in `path` that is missing or shorter than its entries need,
    and how (for messages); None where every file is there and long enough."""
    try:  # a damaged `.metadata` may hold anything: the caller then gives DCP's reason
        metadata = dcp.FileSystemReader(path).read_metadata()
        ends: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
        for name, end in sorted(ends.items()):
            file = path / name
            if not file.is_file():
                return f"{file} is missing"
            if (size := file.stat().st_size) < end:
                return f"{file} is truncated: it has {size} bytes, its entries need {end}"
    except Exception:
        return None
    return None
