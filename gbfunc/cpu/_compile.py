"""Compiling one loop into a shared library in the cache: bounded, crash-safe and verified.

A build must neither hang nor leave something that is later loaded though it was not built
whole. So:
- Builds of one library are serialised by an OS file lock (`fcntl.flock` on `build.lock` in
  its folder), which the kernel releases when its holder dies: a process killed mid-build
  (OOM killer, preemption, a job's time limit) leaves nothing that blocks the next one.
  Waiting for a live holder is bounded (`LOCK_WAIT_S`), and so is the compiler (`COMPILE_S`).
- The compiler writes a temporary file; its size and SHA-256 go into a record beside the
  library (`.so.json`), then both are moved into place with `os.replace`.
- A library is loaded only when the record matches both the inputs it was built from
  (sources, flags, compiler) and the file's size and hash, checked just before loading and
  under the lock: a file cut short by an interrupted copy or a full disk, which `dlopen` would
  map and crash on (SIGBUS), is rebuilt instead.
"""

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the loops stay off there (see `locked`)
    fcntl = None

LOCK_NAME = "build.lock"
LOCK_WAIT_S = 300.0  # waiting for another live process that builds the same library
COMPILE_S = 300.0  # one compiler run; a loop takes seconds
_POLL_S = 0.05
_PARTIAL = ".partial-"  # temporary files' infix; left by a killed build, removed by the next
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # flock not supported there


def load_built(
    compiler: str, source: Path, headers: Sequence[Path], flags: Sequence[str], library: Path
) -> ctypes.CDLL:
    """`library` loaded, built first from `source` (which includes `headers`) with `compiler`
    and `flags` unless the intact build of exactly these inputs is already there.

    Raises:
        TimeoutError: another process held the folder's lock, or the compiler ran, too long.
        RuntimeError: the compiler failed (its output is in the message).
        OSError: the lock or a file could not be had.
    """
    command = [compiler, *flags, "-shared", "-fPIC", f"-I{source.parent}", str(source)]
    inputs = _inputs_digest(command, [source, *headers])
    with locked(library.parent / LOCK_NAME) as held:
        recorded = _recorded_digest(library, inputs)
        if recorded is None or recorded != _file_digest(library):
            _build(command, library, inputs, clean=held)
        return ctypes.CDLL(str(library))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive `flock` on `path` (created where missing; opened read-only in a
    read-only cache), waiting at most `LOCK_WAIT_S` for another holder. The kernel drops the
    lock when its holder's process ends, however it ends. Yields whether the lock is held:
    not on a file system without `flock` (some FUSE mounts, Lustre without `-o flock`),
    where builds go on unlocked: installs are atomic renames, so the worst is two processes
    compiling the same library."""
    if fcntl is None:
        raise OSError(
            "the CPU loops' builds need POSIX file locks (fcntl), which this system lacks"
        )
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:  # a read-only cache: its lock file, read-only, takes a lock too
        if e.errno not in (errno.EROFS, errno.EACCES):
            raise
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    held = True
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in _NO_LOCKS:
                    held = False
                    break
                if not isinstance(e, BlockingIOError):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has been building in {path.parent} for over "
                        f"{LOCK_WAIT_S:g} s (it holds {path.name}); not waiting longer"
                    ) from None
                time.sleep(_POLL_S)
        yield held
    finally:
        os.close(descriptor)  # releases the lock


def _build(command: list[str], library: Path, inputs: str, *, clean: bool = True) -> None:
    """Compile into a temporary file, record its digest, then move both into place; first,
    where `clean` (the folder's lock is held, so no other build is under way), remove the
    temporary files that killed builds left."""
    if clean:
        for stale in library.parent.glob(f"*{_PARTIAL}*"):
            stale.unlink(missing_ok=True)
    partial = library.with_name(f"{library.name}{_PARTIAL}{os.getpid()}")
    record = library.with_name(library.name + ".json")
    record_partial = record.with_name(f"{record.name}{_PARTIAL}{os.getpid()}")
    try:
        returncode, output = _compile([*command, "-o", str(partial)])
        if returncode != 0:
            raise RuntimeError(
                f"the compiler failed (exit {returncode}): {' '.join(command)}\n{output}"
            )
        partial.chmod(0o700)  # ours alone, whatever the umask (`_cache.unsafe_reason`)
        record_partial.write_text(json.dumps({"inputs": inputs, "file": _file_digest(partial)}))
        os.replace(record_partial, record)  # a record without its library: a mismatch, rebuilt
        os.replace(partial, library)
    except BaseException:  # a full disk, the compiler's failure: leave no partial file
        partial.unlink(missing_ok=True)
        record_partial.unlink(missing_ok=True)
        raise


def _compile(command: list[str]) -> tuple[int, str]:
    """Run the compiler in a process group of its own, at most `COMPILE_S`; its exit status
    and output. On a timeout (or any interruption) the whole group is killed: the driver
    alone would leave `cc1plus`, `as` or `ld` running, and writing, with no limit."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=COMPILE_S)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            raise TimeoutError(
                f"the compiler ran over {COMPILE_S:.0f} s: {' '.join(command)}"
            ) from None
        raise
    return process.returncode, output.strip()


def _inputs_digest(command: list[str], files: list[Path]) -> str:
    """A hash of what a build depends on: the compiler command and every source's text."""
    digest = hashlib.sha256("\0".join(command).encode())
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _recorded_digest(library: Path, inputs: str) -> str | None:
    """The file digest recorded at `library`'s build, if that build was of `inputs`."""
    try:
        record = json.loads(library.with_name(library.name + ".json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("inputs") != inputs:
        return None
    return record.get("file")


def _file_digest(path: Path) -> str | None:
    """`size:sha256` of the file at `path`, None where there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"
