"""One thread at a time in calls that swap state into a shared object and back.

`gb.Bottleneck.forward` runs its one p-net through `functional_call`, which puts the generated
tensors in and takes them out again: two threads' calls overlapping ran on each other's
weights and left generated tensors in the p-net. A second thread's overlapping call raises
instead; calls nested in one thread (a hook calling the module again) go on. What is running
is kept here, not on the object, so that a copy (`copy.deepcopy`, pickle) starts free.
"""

import contextlib
import os
import threading
from collections.abc import Iterator

_ENTRY = threading.Lock()  # guards `_CALLERS`
_CALLERS: dict[int, tuple[int, int]] = {}  # id(object): (thread id, depth) while a call runs


@contextlib.contextmanager
def one_thread_at_a_time(owner: object, name: str) -> Iterator[None]:
    """Run the body as `owner`'s call; raise, naming `name`, where another thread's is running.

    Raises:
        RuntimeError: another thread is inside a call of `owner`.
    """
    me, key = threading.get_ident(), id(owner)
    with _ENTRY:
        thread, depth = _CALLERS.get(key, (me, 0))
        if thread != me:
            raise RuntimeError(
                f"{name}: called from a second thread while another thread's call runs; its "
                "one p-net takes each call's weights in turn. Use one per thread "
                "(copy.deepcopy), or a lock around the calls."
            )
        _CALLERS[key] = (me, depth + 1)
    try:
        yield
    finally:
        with _ENTRY:
            if depth:
                _CALLERS[key] = (me, depth)
            else:
                _CALLERS.pop(key, None)


def _forget_other_threads() -> None:
    """In a forked child, where only the forking thread lives: forget the others' calls (and
    a lock another thread may have held at the fork)."""
    global _ENTRY
    _ENTRY = threading.Lock()
    me = threading.get_ident()
    for key, (thread, _) in list(_CALLERS.items()):
        if thread != me:
            del _CALLERS[key]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_other_threads)
