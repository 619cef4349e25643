"""Running code with torch's thread count set: the C loops read it to share out their work."""

import torch


def on_threads(threads, fn, *args):
    """`fn(*args)` with torch's thread count set to `threads`, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(previous)
