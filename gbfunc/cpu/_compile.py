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
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the loops stay off there (see `locked`)
    fcntl = None

LOCK_NAME = "build.lock"
LOCK_WAIT_S = 300.0  # waiting for another live process that builds the same library
WAIT_NOTICE_S = 60.0  # then a warning says what it waits for (a build takes seconds)
COMPILE_S = 300.0  # one compiler run; a loop takes seconds
_POLL_S = 0.05
_PARTIAL = ".partial-"  # temporary files' infix; left by a killed build, removed by the next
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # flock not supported there
_OPEN_LOCKS: set[int] = set()  # lock files this process has open (`locked`)
_OPENING = threading.Lock()  # held across opening a lock file and noting it, and over a fork


def _close_inherited_locks() -> None:
    """In a child of `os.fork`: close its copies of the parent's open lock files. A `flock`
    belongs to the open file, which the child shares, so a child forked during another
    thread's build held that lock for its whole life, and waited `LOCK_WAIT_S` on it itself
    (the parent's copy still holds it until the parent's build ends)."""
    global _OPENING
    _OPENING = threading.Lock()  # the parent's was held for the fork
    for descriptor in _OPEN_LOCKS:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _OPEN_LOCKS.clear()


if hasattr(os, "register_at_fork"):  # no fork between a lock file's opening and its noting
    os.register_at_fork(
        before=lambda: _OPENING.acquire(),
        after_in_parent=lambda: _OPENING.release(),
        after_in_child=_close_inherited_locks,
    )


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
        else:
            try:
                return ctypes.CDLL(str(library))
            except OSError:  # an intact build this host cannot load (another C library)
                _build(command, library, inputs, clean=held)
        return ctypes.CDLL(str(library))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive `flock` on `path` (created where missing; in a read-only cache, a
    shared one where the file is there and the file system locks read-only files), waiting
    at most `LOCK_WAIT_S` for another holder. The kernel drops the
    lock when its holder's process ends, however it ends. Yields whether the lock is held:
    not on a file system without `flock` (some FUSE mounts, Lustre without `-o flock`),
    where builds go on unlocked: installs are atomic renames, so the worst is two processes
    compiling the same library."""
    if fcntl is None:
        raise OSError(
            "the CPU loops' builds need POSIX file locks (fcntl), which this system lacks"
        )
    with _OPENING:
        opened = _open_lock_file(path)
        if opened is not None:
            _OPEN_LOCKS.add(opened[0])
    if opened is None:  # no lock file, and none can be made: none to wait for
        yield False
        return
    descriptor, kind = opened
    held, said = True, False
    try:
        start = time.monotonic()
        deadline = start + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(descriptor, kind | fcntl.LOCK_NB)
                break
            except OSError as e:
                # EBADF: NFS locks only a file open for writing
                if e.errno in _NO_LOCKS or (kind == fcntl.LOCK_SH and e.errno == errno.EBADF):
                    held = False
                    break
                if not isinstance(e, BlockingIOError):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has been building in {path.parent} for over "
                        f"{LOCK_WAIT_S:g} s (it holds {path.name}); not waiting longer"
                    ) from None
                if not said and time.monotonic() - start >= WAIT_NOTICE_S:  # not a silent hang
                    said = True
                    warnings.warn(
                        f"gbfunc: waiting for another process that holds {path} (building the "
                        f"same CPU loop), for up to {LOCK_WAIT_S:g} s; a suspended process "
                        "keeps it: end it, or set GBFUNC_CPU_LOOPS=off.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                time.sleep(_POLL_S)
        yield held
    finally:
        with _OPENING:  # no fork between the two either
            _OPEN_LOCKS.discard(descriptor)
            os.close(descriptor)  # releases the lock


def _open_lock_file(path: Path) -> tuple[int, int] | None:
    """`path` opened for an exclusive lock (created where missing), or, in a read-only
    cache, for a shared one where the file is there; None where it is not and cannot be."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), fcntl.LOCK_EX
    except OSError as e:  # a read-only cache: loaded under a shared lock, where one is had
        if e.errno not in (errno.EROFS, errno.EACCES):
            raise
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW), fcntl.LOCK_SH
    except FileNotFoundError:
        return None


def _build(command: list[str], library: Path, inputs: str, *, clean: bool = True) -> None:
    """Compile into a temporary file, record its digest, then move both into place; first,
    where `clean` (the folder's lock is held, so no other build is under way), remove the
    temporary files that killed builds left."""
    if clean:
        for stale in library.parent.glob(f"*{_PARTIAL}*"):
            stale.unlink(missing_ok=True)
    record = library.with_name(library.name + ".json")
    # names of their own (not the pid's: threads, or containers' processes sharing a pid,
    # build unlocked where there is no flock)
    partial, record_partial = _temporary(library), None
    try:
        record_partial = _temporary(record)
        returncode, output = _compile([*command, "-o", str(partial)])
        if returncode != 0:
            raise RuntimeError(
                f"the compiler failed (exit {returncode}): {' '.join(command)}\n{output}"
            )
        partial.chmod(0o700)  # ours alone, whatever the umask (`_cache.unsafe_reason`)
        record_partial.write_text(json.dumps({"inputs": inputs, "file": _file_digest(partial)}))
        os.replace(record_partial, record)  # a record without its library: a mismatch, rebuilt
        os.replace(partial, library)
    except BaseException as error:  # a full disk, the compiler's failure: leave no partial file
        partial.unlink(missing_ok=True)
        if record_partial is not None:
            record_partial.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:  # a write names no file
            raise OSError(error.errno, f"{error.strerror} (writing in {library.parent})") from None
        raise


def _temporary(target: Path) -> Path:
    """A new, empty temporary file beside `target`, named after it (`_PARTIAL`)."""
    descriptor, name = tempfile.mkstemp(dir=target.parent, prefix=target.name + _PARTIAL)
    os.close(descriptor)
    return Path(name)


def _compile(command: list[str]) -> tuple[int, str]:
    """Run the compiler in a process group of its own, at most `COMPILE_S`; its exit status
    and output. On a timeout (or any interruption) the whole group is killed: the driver
    alone would leave `cc1plus`, `as` or `ld` running, and writing, with no limit. The output
    goes to a file, and the wait is for the compiler itself: a helper a compiler wrapper
    leaves behind (a compile-cache server) holds a pipe open, not the build."""
    with tempfile.TemporaryFile(mode="w+") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            process.wait(timeout=COMPILE_S)
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise TimeoutError(
                    f"the compiler ran over {COMPILE_S:.0f} s: {' '.join(command)}"
                ) from None
            raise
        output.seek(0)
        return process.returncode, output.read().strip()


def _inputs_digest(command: list[str], files: list[Path]) -> str:
    """A hash of what a build depends on: the compiler command and every source's text, the
    machine's architecture and C library, and the compiler's file (a cache shared by hosts of
    another kind, or a compiler upgraded, builds anew)."""
    found = shutil.which(command[0])
    compiler = os.stat(found) if found else None
    host = (platform.machine(), platform.libc_ver(), found, compiler and compiler.st_size)
    digest = hashlib.sha256("\0".join([*command, repr(host)]).encode())
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
