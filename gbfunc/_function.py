"""`torch.autograd.Function` classes that bind their arguments without rebuilding a signature.

With a `setup_context`, `Function.apply` binds every call's arguments to `forward`'s
signature, and `inspect.signature` builds that signature anew each time, once per stack on
every `gb.apply` (what that costs: `docs/performance.md`). `inspect.signature`
returns a function's `__signature__` where one is set, so setting it once, at class
creation, keeps the binding and drops the rebuilding.
"""

import inspect
from typing import TypeVar

import torch

FunctionType = TypeVar("FunctionType", bound=type[torch.autograd.Function])


def signature_once(cls: FunctionType) -> FunctionType:
    """Class decorator: `cls.forward`'s signature computed here, once, for every `cls.apply`."""
    cls.forward.__signature__ = inspect.signature(cls.forward)
    return cls
