"""Building, loading and launching the CPU loops: which flags, where, what happens when a
build fails, and how a loop shares its tiles out among threads.

Each loop is a C++ file in `gbfunc/cpu/csrc/`, specialised by `-DHIDDEN=` and `-DOUTPUTS=`
(sums over units and outputs unroll and vectorise with their counts fixed), compiled on first
use (`_compile`: an OS file lock that a killed process cannot leave behind, bounded waits, a
library loaded only if it is the one that was built) into a private cache folder (`_cache`).
The ISA flags come from torch's public `torch.backends.cpu.get_cpu_capability()` and name the
build, so a home folder shared by nodes of different CPUs keeps one build each.

The loops are optional. `GBFUNC_CPU_LOOPS` (or `gbfunc.cpu.set_mode`; kept in `_mode`, which
records a failure too) chooses:
- `auto` (default): on Linux x86-64 with AVX2 or AVX-512, built for that ISA; elsewhere off.
- `portable`: built without ISA flags (the loops' portable branches), on any CPU.
- `off`: never built or loaded; every stack runs through pure torch.
A build or load that fails (no C++ compiler, a compiler error, an unsafe cache folder, a
build that another process holds too long) turns the loops off for the process, with one
warning that says why; results are the same either way, to rounding. Loops already loaded
stay callable whatever happens later (`runnable`), so code traced with them keeps working.
"""

import ctypes
import functools
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from ._cache import cache_root, private_folder, unsafe_reason
from ._compile import load_built
from ._mode import MODE_VARIABLE, failure, mode, record_failure

SOURCES = Path(__file__).parent / "csrc"

# Flags per ISA, those of the vector ISAs that inductor's own CPU code is built for.
_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}
_COMMON_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=fast")
_HEADERS = tuple(sorted(SOURCES.glob("*.h")))


class Loop(NamedTuple):
    """A C-linkage function of a source in `csrc/`: its name, its file, and how many tensor
    pointers and sizes (int64) it takes, then the thread count (int)."""

    name: str
    source: str
    pointers: int
    sizes: int


_libraries: dict[tuple, ctypes.CDLL] = {}  # per source, units, outputs and build
_functions: dict[tuple, ctypes._CFuncPtr] = {}  # per loop, units, outputs and build
_warned_compiler = False  # `missing_compiler` has warned


def flavour() -> str | None:
    """The build the mode in force asks for here: an ISA name, `portable`, or None (off)."""
    chosen = mode()
    if chosen == "off":
        return None
    if chosen == "portable":
        return "portable"
    return _native_flavour()


@functools.cache
def _native_flavour() -> str | None:
    """`auto`'s build: the CPU's ISA on Linux x86-64 where it has AVX2 or AVX-512, else None."""
    capability = torch.backends.cpu.get_cpu_capability()
    on_linux_x86 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
    return capability if on_linux_x86 and capability in _ISA_FLAGS else None


def compiler() -> str | None:
    """The C++ compiler builds would use (`$CXX`, else `c++`), where it is found, else None
    (looked for again on each call until found: one installed meanwhile is seen)."""
    key = (os.environ.get("CXX") or "c++", os.environ.get("PATH"))
    if (found := _FOUND.get(key)) is None:  # one lookup: another thread may clear it
        found = shutil.which(key[0], path=key[1])
        if found is None:
            return None
        if len(_FOUND) >= 8:
            _FOUND.clear()
        _FOUND[key] = found
    return found


_FOUND: dict[tuple[str, str | None], str] = {}


def missing_compiler(*, warn: bool) -> str | None:
    """Why nothing compiled runs on CPU here (no C++ compiler for the loops nor for inductor),
    or None; with `warn`, the first time also says so in a warning (once per process)."""
    if compiler() is not None:
        return None
    name = os.environ.get("CXX") or "c++"
    reason = f"no C++ compiler: {name} is not on PATH (set CXX)"
    if len(name.split()) > 1 and not Path(name).exists():  # torch's inductor reads it whole too
        reason = (
            f"no C++ compiler: CXX={name!r} names no program; CXX is one compiler's path or "
            "name, without arguments (put a wrapper such as ccache in a script)"
        )
    global _warned_compiler
    if warn and not _warned_compiler:
        _warned_compiler = True
        warnings.warn(
            f"gbfunc: {reason}; the CPU loops and compiled generation are off, and every stack "
            "runs through pure torch (same results, slower on CPU).",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason


def unavailable_reason() -> str | None:
    """Why no loop runs in this process, or None where they may (each still built on use)."""
    if (failed := failure()) is not None:
        return failed
    if mode() != "off" and (missing := missing_compiler(warn=False)):
        return missing
    if flavour() is None:
        if mode() == "off":
            return f"{MODE_VARIABLE} (or gbfunc.cpu.set_mode) is 'off'"
        return (
            f"mode 'auto' builds the loops on Linux x86-64 with AVX2 or AVX-512 only (this is "
            f"{sys.platform} {platform.machine()}, {torch.backends.cpu.get_cpu_capability()}); "
            "'portable' builds them anywhere"
        )
    return None


def vectorised_cpu(dtype: torch.dtype, device_type: str) -> bool:
    """Whether loops may run for tensors of `dtype` on `device_type`: CPU float32, with the
    loops on (`unavailable_reason` is None)."""
    return device_type == "cpu" and dtype == torch.float32 and unavailable_reason() is None


def compiled_loop(loop: Loop, units: int, outputs: int = 1) -> ctypes._CFuncPtr | None:
    """`loop` built for `units` units and `outputs` outputs, loaded; None where the loops are
    off, or the build or load failed (then off for the process, with one warning)."""
    build = flavour()
    if build is None or failure() is not None:
        return None
    key = (loop, units, outputs, build)
    function = _functions.get(key)
    if function is None:
        library = (loop.source, units, outputs, build)
        try:
            if library not in _libraries:
                _libraries[library] = _load(loop.source, units, outputs, build)
            function = getattr(_libraries[library], loop.name)
        except Exception as error:  # an optional path: whatever broke, torch runs instead
            _fail(f"{type(error).__name__}: {error}")
            return None
        function.argtypes = (
            [ctypes.c_void_p] * loop.pointers + [ctypes.c_int64] * loop.sizes + [ctypes.c_int]
        )
        function.restype = None
        _functions[key] = function
    return function


def runnable(loop: Loop, units: int, outputs: int = 1) -> ctypes._CFuncPtr:
    """`loop` for `units` and `outputs`, to run now: the function loaded earlier in this process
    even if the mode changed or another build failed since (a loaded library stays valid, and
    code traced with it must keep working), else `compiled_loop`'s.

    Raises:
        RuntimeError: it was never loaded and cannot be now.
    """
    function = _functions.get((loop, units, outputs, flavour())) or next(
        (f for key, f in tuple(_functions.items()) if key[:3] == (loop, units, outputs)),
        None,
    )
    if function is None:
        function = compiled_loop(loop, units, outputs)
    if function is None:
        raise RuntimeError(
            f"gbfunc: the CPU loop {loop.name} for {units} units and {outputs} outputs was "
            f"asked for but is not loaded ({unavailable_reason()}); code traced where the loops "
            "were on runs again after torch._dynamo.reset()."
        )
    return function


def build_folders(source: str, units: int, outputs: int, build: str) -> tuple[str, ...]:
    """The folders under `cache_root()` that a build lives in; the last names the library."""
    name = f"gbfunc_{Path(source).stem}_{units}_{outputs}_{build.lower()}"
    return ("cpu-loops", f"torch-{torch.__version__}", name)


def _load(source: str, units: int, outputs: int, build: str) -> ctypes.CDLL:
    """Build `source` for `units` and `outputs` (or reuse the intact cached build) and load
    it, from a folder that only the current user can write to, after checking the file too."""
    parts = build_folders(source, units, outputs, build)
    folder = private_folder(cache_root(), *parts)
    library = folder / f"{parts[-1]}.so"
    if library.exists():
        _check_file(library)
    flags = [
        *_COMMON_FLAGS,
        *_ISA_FLAGS.get(build, ()),
        f"-DHIDDEN={units}",
        f"-DOUTPUTS={outputs}",
    ]
    return load_built(compiler() or "c++", SOURCES / source, _HEADERS, flags, library)


def _check_file(path: Path) -> None:
    reason = unsafe_reason(path, directory=False)
    if reason:
        raise PermissionError(reason)


def _fail(reason: str) -> None:
    """Turn the loops off for this process, warning once with `reason`."""
    message = record_failure(reason)
    warnings.warn(
        f"gbfunc: the CPU loops are off for this process; every stack runs through pure torch "
        f"(same results, slower on CPU). {message}. Set {MODE_VARIABLE}=off to skip them "
        "without this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


# Launching a loop: threads, row splits, genomes batched by vmap.


def launch(
    loop: Loop, units: int, outputs: int, *args: object, tiles: tuple[int, int] | None = None
) -> None:
    """Run `loop` for `units` and `outputs` (`runnable`) on `args`: tensors, passed as their
    data pointers; lists of tensors (None: absent), as an array of pointers; sizes, as they
    are. `tiles`: the g-nets' tile count and the placement's, which must agree.

    A loop reads raw pointers, so each tensor is checked first: on the CPU, with data, and
    float32 where it holds floats (a bfloat16 tensor was read as float32 past its end, a meta
    table written through a null pointer), and the tile counts, which come one from the
    tensors and one from the plan (another plan's g-nets wrote past a weight's end).
    """
    if tiles is not None and tiles[0] != tiles[1]:
        raise RuntimeError(
            f"gbfunc.cpu: the loop {loop.name} got g-nets for {tiles[0]} tiles where the plan "
            f"places {tiles[1]}: gparams of another plan? gbfunc's checks should have "
            "refused them: please report it."
        )
    arguments = [_argument(loop, a) for a in args]  # checked before a build is asked for
    runnable(loop, units, outputs)(*arguments)


def _argument(loop: Loop, value: object) -> object:
    """`value` as the loop's C function takes it (`launch`), its tensors checked."""
    if isinstance(value, Tensor):
        return _pointer(loop, value)
    if isinstance(value, list):
        held = [None if t is None else _pointer(loop, t) for t in value]
        return (ctypes.c_void_p * len(held))(*held)
    return value


def _pointer(loop: Loop, t: Tensor) -> int:
    """`t`'s data pointer, if a loop can read it: a CPU tensor with data, float32 if it holds
    floats. A training step checks dozens of tensors, hence `is_cpu` and `is` (no
    `torch.device` object, no dtype comparison through Python) and one `data_ptr` call."""
    if t.is_cpu:
        pointer = t.data_ptr()
        if (pointer or not t.numel()) and (t.dtype is torch.float32 or not t.is_floating_point()):
            return pointer
    raise RuntimeError(
        f"gbfunc.cpu: the loop {loop.name} takes CPU tensors with data, float32 where they hold "
        f"floats, got {t.dtype} on {t.device}; gbfunc's dispatcher should not have sent it "
        "here: please report it (GBFUNC_CPU_LOOPS=off avoids the loops meanwhile)."
    )


def threads_and_splits(tiles: int, tile_rows: int) -> tuple[int, int]:
    """torch's thread count, and into how many row ranges the loops split each tile: tiles
    are shared out among the threads; too few of them and each is split by rows, every split
    with its own partial sums (`splits_added`)."""
    threads = torch.get_num_threads()
    return threads, max(1, min(tile_rows, -(-threads // tiles)))


def splits_added(partials: Tensor) -> Tensor:
    """`(T, splits, ...)` partial sums, one per row split, added: `(T, ...)`."""
    return partials[:, 0] if partials.shape[1] == 1 else partials.sum(1)


def tiles_folded(size: int, in_dims: tuple, args: tuple) -> list[Tensor]:
    """Genomes batched by `vmap` are more tiles: the batch axis folded into the tile axis."""
    return [
        (x.movedim(d, 0) if d is not None else x.expand(size, *x.shape)).flatten(0, 1)
        for x, d in zip(args, in_dims, strict=True)
    ]


def tiles_unfolded(size: int, x: Tensor) -> Tensor:
    """`tiles_folded`'s inverse on a result: `(size * T, ...) -> (size, T, ...)`."""
    return x.unflatten(0, (size, -1))
