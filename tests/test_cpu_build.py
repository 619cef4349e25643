"""The CPU loops' build under faults (issue 53, rows 1, 4 and 5): a build killed midway, a
build another process holds, a library cut short in the cache, and loops switched off or
failing after code was traced with them. Rows 1 and 4 run real processes: one that is killed,
one that would crash on a bad library."""

import contextlib
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gbfunc as gb
from gbfunc.cpu import _build, _compile, _relu_loops

pytestmark = pytest.mark.skipif(
    _build.flavour() is None or _build.compiler() is None,
    reason="the loops are not built on this machine (mode, platform or compiler)",
)

UNITS = 5  # a unit count no other test builds, so each test starts from an empty folder

# Builds the one-output backward's loop for UNITS units and checks it against its
# specification; prints the warnings it saw. Run in a process of its own.
BUILD_AND_CHECK = textwrap.dedent(
    f"""
    import warnings
    import torch
    from gbfunc.cpu import _relu_loops

    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        usable = _relu_loops.sums_usable({UNITS}, torch.float32, "cpu")
    g, threshold, b = torch.randn(3, 4, 6), torch.randn(3, 4, {UNITS}), torch.randn(3, 6, {UNITS})
    if usable:
        for got, want in zip(_relu_loops.relu_unit_sums(g, threshold, b),
                             _relu_loops.sums_reference(g, threshold, b)):
            torch.testing.assert_close(got, want)
    print("usable" if usable else "not usable", [str(w.message) for w in caught])
    """
)


def environment(cache: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child that builds into `cache`, in `auto` mode."""
    dropped = ("CXX", _build.MODE_VARIABLE)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "GBFUNC_CACHE_DIR": str(cache), **extra}


def build_and_check(cache: Path) -> subprocess.CompletedProcess:
    """`BUILD_AND_CHECK` in a process of its own, building into `cache`."""
    return subprocess.run(
        [sys.executable, "-c", BUILD_AND_CHECK],
        env=environment(cache),
        capture_output=True,
        text=True,
        timeout=240,
    )


def build_folder(cache: Path) -> Path:
    return cache.joinpath(*_build.build_folders("relu_unit_sums.cpp", UNITS, 1, _build.flavour()))


def library_of(cache: Path) -> Path:
    folder = build_folder(cache)
    return folder / f"{folder.name}.so"


@pytest.mark.slow
def test_a_build_killed_midway_leaves_nothing_that_makes_the_next_one_wait(tmp_path):
    """Row 1: a process killed while it builds (here: while its compiler runs) left torch's
    build `lock` behind and every later build waited on it forever. The next process now
    builds at once, and finds the loop equal to its specification."""
    cache, started = tmp_path / "cache", tmp_path / "compiler-started"
    hanging = tmp_path / "hanging-compiler"
    # The compiler runs in a process group of its own (so that a timeout kills all of it):
    # it writes its pid where this test can end it.
    hanging.write_text(f"#!/bin/sh\necho $$ > {started}.pid\ntouch {started}\nexec sleep 300\n")
    hanging.chmod(0o755)
    victim = subprocess.Popen(
        [sys.executable, "-c", BUILD_AND_CHECK], env=environment(cache, CXX=str(hanging))
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert victim.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build never started its compiler"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)  # the build's own process; its compiler lives on
        victim.wait()
        (build_folder(cache) / "lock").touch()  # what torch's cpp_extension left behind
        began = time.monotonic()
        next_one = build_and_check(cache)
    finally:
        victim.kill()
        victim.wait()
        if started.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(Path(f"{started}.pid").read_text()), signal.SIGKILL)
    assert next_one.returncode == 0, next_one.stderr[-3000:]
    assert next_one.stdout.startswith("usable []"), next_one.stdout
    assert time.monotonic() - began < 120
    assert not list(build_folder(cache).glob("*partial*"))  # the killed build's file is gone


def test_a_build_held_by_a_live_process_is_waited_for_within_a_bound(fresh_loops, monkeypatch):
    """Row 1, the bounded wait: while another holder keeps the folder's lock, a build gives up
    after `LOCK_WAIT_S` with one warning naming the folder, and the call runs through torch."""
    folder = build_folder(fresh_loops)
    folder.mkdir(parents=True, mode=0o700)
    for parent in [folder, *folder.relative_to(fresh_loops).parents]:
        (fresh_loops / parent).chmod(0o700)
    monkeypatch.setattr(_compile, "LOCK_WAIT_S", 0.6)
    monkeypatch.setattr(_compile, "WAIT_NOTICE_S", 0.2)  # it waited 300 s without a word
    held = _compile.locked(folder / _compile.LOCK_NAME)  # another open file: another holder
    with held, pytest.warns(RuntimeWarning) as caught:
        assert not _relu_loops.sums_usable(UNITS, torch.float32, "cpu")
    waiting = f"gbfunc: waiting for another process that holds {folder / _compile.LOCK_NAME}"
    assert len(caught) == 2
    assert str(caught[0].message).startswith(waiting)
    assert f"building in {folder}" in str(caught[1].message)
    plan = gb.plan(nn.Linear(20, 12), tile=(8, 8), hidden=UNITS)
    gparams = gb.init(plan, seed=0)
    explained = gb.explain(gparams, plan, compile=True)
    assert "cpu-loops" not in explained.route.stacks
    assert f"building in {folder}" in explained.reasons[plan.stacks[0].key]["cpu-loops"]
    gb.apply(gparams, plan, compile=False)["weight"].sum().backward()


@pytest.mark.parametrize("damage", ["cut short", "emptied", "record lost", "another machine's"])
def test_a_damaged_library_in_the_cache_is_rebuilt_not_loaded(damage, tmp_path):
    """Row 4: a library cut short in the cache (an interrupted copy or sync, a full disk) was
    mapped by `dlopen` and crashed every process with SIGBUS. It is now checked against the
    size and hash recorded when it was built, and rebuilt."""
    cache = tmp_path / "cache"
    first = build_and_check(cache)
    assert first.stdout.startswith("usable []"), first.stderr[-3000:]
    library = library_of(cache)
    whole = library.read_bytes()
    if damage == "cut short":
        library.write_bytes(whole[: len(whole) // 3])
    elif damage == "emptied":
        library.write_bytes(b"")
    elif damage == "record lost":
        library.with_name(library.name + ".json").unlink()
    else:  # an aarch64 build with a matching record (a home shared by hosts of two kinds): it
        # was loaded, failed, and turned the loops off in every process until deleted by hand
        other = bytearray(whole)
        other[18:20] = (183).to_bytes(2, "little")  # the ELF header's machine: EM_AARCH64
        library.write_bytes(bytes(other))
        record = library.with_name(library.name + ".json")
        made = json.loads(record.read_text())
        made["file"] = f"{len(other)}:{hashlib.sha256(other).hexdigest()}"
        record.write_text(json.dumps(made))
    again = build_and_check(cache)
    assert again.returncode == 0, (again.returncode, again.stderr[-3000:])
    assert again.stdout.startswith("usable []"), again.stdout
    assert library.stat().st_size == len(whole)


def row_gnets() -> tuple[gb.Plan, dict]:
    """Row g-nets of one ReLU layer, which take the loops under `compile=True`."""
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, tile=(16, 16), hidden=8, outputs=16)
    return plan, gb.init(plan, seed=0)


@pytest.mark.slow
def test_code_traced_with_the_loops_keeps_working_when_they_are_switched_off_or_fail():
    """Row 5: `torch.compile(lambda g: gb.apply(g, p))`, then `gb.cpu.set_mode('off')`, or a
    failed build elsewhere: the traced code called a loop that was no longer handed out
    (`TypeError: 'NoneType' object is not callable`). Loaded loops stay callable."""
    plan, gparams = row_gnets()
    assert gb.explain(gparams, plan, compile=True).route.stacks == ("cpu-loops", "cpu-loops")
    traced = torch.compile(lambda g: gb.apply(g, plan, compile=True))
    want = traced(gparams)
    try:
        gb.cpu.set_mode("off")
        for name, weight in traced(gparams).items():
            torch.testing.assert_close(weight, want[name], rtol=0, atol=0)
        gb.cpu.set_mode(None)
        with pytest.warns(RuntimeWarning, match="a build elsewhere failed"):
            _build._fail("a build elsewhere failed")
        for name, weight in traced(gparams).items():
            torch.testing.assert_close(weight, want[name], rtol=0, atol=0)
    finally:
        gb.cpu.set_mode(None)  # also forgets the failure


def test_a_loop_switched_off_between_the_check_and_the_call_still_runs():
    """Row 5, eagerly: another thread switches the mode after a stack chose the loops and
    before it called them; the call completes, with the loop's results."""
    g, threshold, b = torch.randn(3, 4, 6), torch.randn(3, 4, 7), torch.randn(3, 6, 7)
    assert _relu_loops.sums_usable(7, torch.float32, "cpu")
    try:
        gb.cpu.set_mode("off")
        got = _relu_loops.relu_unit_sums(g, threshold, b)
    finally:
        gb.cpu.set_mode(None)
    for x, y in zip(got, _relu_loops.sums_reference(g, threshold, b), strict=True):
        torch.testing.assert_close(x, y)


def test_a_loop_never_loaded_says_so_instead_of_calling_nothing(fresh_loops):
    gb.cpu.set_mode("off")
    try:
        with pytest.raises(RuntimeError, match=r"relu_unit_sums for 9 units .* not loaded"):
            _build.runnable(_relu_loops._SUMS, 9)
    finally:
        gb.cpu.set_mode(None)


def read_only(real_open):
    """`os.open` on a read-only file system: creating a file raises EROFS."""

    def opened(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    return opened


def test_a_cache_without_flock_or_read_only_still_takes_the_lock_path(tmp_path, monkeypatch):
    """A read-only cache (a container image's) could not open its lock file for writing, and
    a file system without flock raised ENOLCK: either turned the loops off even with a good
    build there. A read-only lock file takes the lock; without flock the build goes on
    unlocked, and leaves other builds' temporary files alone."""
    lock = tmp_path / _compile.LOCK_NAME
    lock.touch()
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", read_only(os.open))
        with _compile.locked(lock) as held:
            assert held

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(_compile.fcntl, "flock", no_locks)
    with _compile.locked(lock) as held:
        assert not held


def test_a_read_only_cache_loads_without_its_lock_file_or_where_nfs_refuses_the_lock(
    tmp_path, monkeypatch
):
    """A read-only cache whose lock file is gone (FileNotFoundError), or on NFS, which locks
    only a file open for writing (EBADF), turned the loops off with a good build there: a
    read-only cache takes a shared lock where it can, and none where it cannot."""
    lock = tmp_path / _compile.LOCK_NAME
    real_flock = _compile.fcntl.flock
    with monkeypatch.context() as patch:
        patch.setattr(os, "open", read_only(os.open))
        with _compile.locked(lock) as held:  # no lock file, and none can be made
            assert not held
    lock.touch()
    monkeypatch.setattr(os, "open", read_only(os.open))
    taken = []
    monkeypatch.setattr(
        _compile.fcntl, "flock", lambda d, op: taken.append(op) or real_flock(d, op)
    )
    with _compile.locked(lock) as held:
        assert held
    assert taken[0] & _compile.fcntl.LOCK_SH

    def nfs(descriptor, operation):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(_compile.fcntl, "flock", nfs)
    with _compile.locked(lock) as held:
        assert not held


def _fake_compiler(tmp_path: Path, body: str) -> str:
    script = tmp_path / "cc"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def test_a_compiler_over_its_time_is_killed_with_everything_it_started(tmp_path, monkeypatch):
    """The timeout killed the driver alone: cc1plus, as or ld ran on, unbounded."""
    started = tmp_path / "child.pid"
    compiler = _fake_compiler(tmp_path, f"sleep 60 & echo $! > {started}\nwait\n")
    monkeypatch.setattr(_compile, "COMPILE_S", 1.0)
    with pytest.raises(TimeoutError, match="the compiler ran over 1 s"):
        _compile._compile([compiler])
    child = int(started.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


def test_a_helper_the_compiler_leaves_running_does_not_hold_the_build(tmp_path, monkeypatch):
    """A compiler wrapper that starts a detached helper (a compile-cache server) kept the
    output pipe open: the build waited for the helper, past the compiler's time limit."""
    helper = tmp_path / "helper.pid"
    compiler = _fake_compiler(tmp_path, f"setsid sleep 30 &\necho $! > {helper}\necho compiled\n")
    monkeypatch.setattr(_compile, "COMPILE_S", 20.0)
    start = time.perf_counter()
    try:
        assert _compile._compile([compiler]) == (0, "compiled")
        assert time.perf_counter() - start < 10
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int(helper.read_text()), signal.SIGKILL)


def test_builds_without_flock_in_one_process_do_not_share_temporary_files(tmp_path):
    """Where there is no flock, builds go on unlocked; the temporary files were named by
    the pid alone, so two threads (or containers' processes of one pid) wrote one file, and
    one loaded what the other was writing or failed on its rename."""
    import threading

    compiler = _fake_compiler(tmp_path, 'for last; do :; done\nsleep 0.5\necho built > "$last"\n')
    library, errors = tmp_path / "lib.so", []

    def build() -> None:
        try:
            _compile._build([compiler], library, "inputs", clean=False)
        except Exception as e:  # any failure of either thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert library.read_text() == "built\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cc", "lib.so", "lib.so.json"]


def test_a_compiler_installed_while_running_is_found(tmp_path, monkeypatch):
    """`compiler()` remembered not finding one, and the routes chosen then stayed after
    `gb.cpu.set_mode(None)`: a compiler installed meanwhile was never used."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "gbfunc-test-c++")
    assert _build.compiler() is None
    before = gb.cpu.loops_state()
    _fake_compiler(tmp_path, "exit 0\n")
    (tmp_path / "cc").rename(tmp_path / "gbfunc-test-c++")
    assert _build.compiler() == str(tmp_path / "gbfunc-test-c++")
    gb.cpu.set_mode(None)
    assert gb.cpu.loops_state() != before


def test_a_compiler_variable_with_arguments_is_named_as_such(monkeypatch):
    """`CXX="ccache g++"` was reported as a compiler missing from PATH."""
    monkeypatch.setenv("CXX", "ccache g++")
    reason = _build.missing_compiler(warn=False)
    assert reason is not None
    assert "CXX='ccache g++' names no program" in reason
    assert "without arguments" in reason


def test_a_build_that_fails_after_compiling_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk at the record's write left the library's and the record's temporary files
    on the full disk until that library was built again."""
    compiler = _fake_compiler(tmp_path, 'for last; do :; done\necho built > "$last"\n')
    real_write = Path.write_text

    def disk_full(self, *args, **kwargs):
        if _compile._PARTIAL in self.name:
            real_write(self, "")  # the file exists, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write names no file
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)
    library = tmp_path / "lib.so"
    with pytest.raises(OSError, match=f"No space left on device \\(writing in {tmp_path}\\)"):
        _compile._build([compiler], library, "inputs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cc"]


def test_the_cache_folder_variable_takes_a_home_relative_or_relative_path(tmp_path, monkeypatch):
    """A quoted GBFUNC_CACHE_DIR="~/.cache/gbfunc" made a folder named '~' in every working
    directory, each with its own builds."""
    from gbfunc.cpu import _cache

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(_cache.CACHE_VARIABLE, "~/.cache/gbfunc")
    assert _cache.cache_root() == tmp_path / ".cache" / "gbfunc"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_cache.CACHE_VARIABLE, "here")
    assert _cache.cache_root() == tmp_path / "here"


def test_a_child_forked_during_a_threads_build_does_not_keep_its_lock(tmp_path, monkeypatch):
    """`flock` belongs to the open file, which `fork` shares: a child forked while another
    thread held a build's lock kept it for its whole life and timed out waiting on it."""
    monkeypatch.setattr(_compile, "LOCK_WAIT_S", 10.0)
    lock = tmp_path / _compile.LOCK_NAME
    holding, release = threading.Event(), threading.Event()

    def build() -> None:
        with _compile.locked(lock):
            holding.set()
            release.wait(30)

    builder = threading.Thread(target=build)
    builder.start()
    assert holding.wait(30)
    child = os.fork()
    if child == 0:  # the child: the lock is had once the parent's build ends
        code = 1
        try:
            with _compile.locked(lock) as held:
                code = 0 if held else 2
        finally:
            os._exit(code)
    release.set()
    builder.join()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
