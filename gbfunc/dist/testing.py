"""Run a function on a few local gloo ranks, in fresh processes, for tests on CPU machines.

Rendezvous goes through a `FileStore` in a fresh temporary directory (no ports, no clashes
between parallel jobs), gloo talks over loopback only, each rank uses one thread, a stuck
collective raises after `pg_timeout`, and the whole run is killed after `timeout`. A child's
exception is re-raised in the caller with the child's traceback.
"""

import datetime
import importlib.util
import inspect
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 20.0,
) -> list[Any]:
    """Call `worker(rank, world_size, *args)` on `world_size` gloo ranks; return their results.

    Args:
        worker: A module-level function (found again in the children by its file and name,
            so test modules imported by path work).
        world_size: Number of ranks (processes).
        *args: Picklable arguments for every rank.
        timeout: Seconds before every rank is killed and `TimeoutError` raised.
        pg_timeout: Process-group timeout in seconds: a collective waiting longer raises.

    Returns:
        Each rank's return value, or `None` for a rank that exited without returning.

    Examples:
        With `check` defined at the top level of a module (the children import it):

        >>> def check(rank, world): return dist.get_world_size()  # doctest: +SKIP
        >>> spawn(check, 2)  # doctest: +SKIP
        [2, 2]
    """
    if worker.__qualname__ != worker.__name__:
        raise ValueError(
            "gb.dist.testing.spawn: worker must be a module-level function, "
            f"got {worker.__qualname__}."
        )
    where = (inspect.getfile(worker), worker.__module__, worker.__name__)
    with tempfile.TemporaryDirectory(prefix="gbdist_") as tmp:
        context = mp.start_processes(
            _entry,
            args=(where, world_size, tmp, pg_timeout, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                    process.join()
                raise TimeoutError(
                    f"gb.dist.testing.spawn: {worker.__name__} on {world_size} ranks "
                    f"ran over {timeout} s."
                )
        return [_result(os.path.join(tmp, f"result{rank}.pkl")) for rank in range(world_size)]


def _result(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _load(where: tuple[str, str, str]) -> Callable[..., Any]:
    path, module, name = where
    try:  # the same file under its own name when importable (e.g. a module of a package)
        found = importlib.import_module(module)
        if os.path.samefile(inspect.getfile(found), path):
            return getattr(found, name)
    except (ImportError, TypeError, OSError):
        pass
    spec = importlib.util.spec_from_file_location(f"_gbdist_worker_{abs(hash(path))}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, name)


def _entry(
    rank: int,
    where: tuple[str, str, str],
    world_size: int,
    tmp: str,
    pg_timeout: float,
    args: tuple,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    worker = _load(where)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(tmp, "store"), world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        result = worker(rank, world_size, *args)
        with open(os.path.join(tmp, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
