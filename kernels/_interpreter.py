"""Triton's interpreter, as far as Triton 3.6 needs a fix to run these kernels on CPU.

The backward kernel loops over runtime bounds (`range(0, tl.cdiv(Q, BLOCK_Q))`): compiled, the
bound is a value in a register; interpreted, it is a scalar tensor whose data is a NumPy array
of shape `(1,)`, and Python's `range` asks it for `__index__`. Triton 3.6's interpreter answers
`int(data)`, which NumPy deprecated for arrays with `ndim > 0` (1.25, a warning our tests turn
into an error) and refuses from NumPy 2.4 (`TypeError: only 0-dimensional arrays can be
converted to Python scalars`). Later Triton (3.9 here) answers `int(data.squeeze())`; this
module gives an older interpreter the same answer, and nothing else.

Only the interpreter changes, only when the process runs it (`TRITON_INTERPRET=1`, read as in
`_runtime`) and only where it has the fault: whatever is compiled for a GPU is the same with or
without this module. It is imported by `_gnet` (both kernels import that),
so the fix is in place before any kernel runs.
"""

import operator
import os
import warnings

import numpy as np
from triton.runtime import interpreter


def _index(self):
    return int(self.handle.data.squeeze())


def _has_fault() -> bool:
    """Whether this Triton's interpreter fails `__index__` of a scalar tensor (shape `(1,)`)."""

    class Handle:
        data = np.array([3], dtype=np.int32)

    class Tensor:
        handle = Handle()

    scope = interpreter._LangPatchScope()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            interpreter._patch_lang_tensor(Tensor, scope)
            operator.index(Tensor())
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()
    return False


def _patch_lang_tensor(tensor, scope, _original=interpreter._patch_lang_tensor):
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", _index)


def fix() -> bool:
    """Give the interpreter's scalar tensors a working `__index__`; whether it needed one."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False  # compiled kernels: the interpreter never runs, nothing to change
    if getattr(interpreter._patch_lang_tensor, "__module__", None) == __name__:
        return True  # already fixed
    try:
        faulty = _has_fault()
    except Exception:  # another Triton's interpreter, laid out otherwise: leave it as it is
        return False
    if faulty:
        interpreter._patch_lang_tensor = _patch_lang_tensor
    return faulty


fix()
