"""One thread at a time in calls that swap state into a shared object and back.

`gb.Bottleneck.forward` runs its one p-net through `functional_call`, which puts the generated
tensors in and takes them out again: two threads' calls overlapping ran on each other's
weights and left generated tensors in the p-net. A second thread's overlapping call raises
instead; calls nested in one thread (a hook calling the module again) go on.
"""

import contextlib
import threading
from collections.abc import Iterator

# Guards the check of which thread is inside (module-level: a lock held by the object would
# not pickle or deepcopy with it).
_ENTRY = threading.Lock()
_CALLER = "_gbfunc_caller"  # the object's attribute: (thread id, depth) while a call runs


@contextlib.contextmanager
def one_thread_at_a_time(owner: object, name: str) -> Iterator[None]:
    """Run the body as `owner`'s call; raise, naming `name`, where another thread's is running.

    Raises:
        RuntimeError: another thread is inside a call of `owner`.
    """
    me = threading.get_ident()
    with _ENTRY:
        thread, depth = owner.__dict__.get(_CALLER, (me, 0))
        if thread != me:
            raise RuntimeError(
                f"{name}: called from a second thread while another thread's call runs; its "
                "one p-net takes each call's weights in turn. Use one per thread "
                "(copy.deepcopy), or a lock around the calls."
            )
        owner.__dict__[_CALLER] = (me, depth + 1)
    try:
        yield
    finally:
        with _ENTRY:
            if depth:
                owner.__dict__[_CALLER] = (me, depth)
            else:
                del owner.__dict__[_CALLER]
