"""Importing gbfunc leaves `os.environ` as it found it.

`torch.compiler`'s decorators on gbfunc's functions import `torch._dynamo`, whose import
writes `TORCHINDUCTOR_CACHE_DIR` (torch's `cache_dir()`). torch writes it again whenever it
next needs its cache, so removing what the import added changes nothing for torch and keeps
the variable out of the environment other libraries and child processes see.
"""

import os

# The variables before gbfunc's modules load: gbfunc/__init__.py imports this module first.
_BEFORE = frozenset(os.environ)


def restore() -> None:
    """Remove the variables added to `os.environ` since gbfunc's import began."""
    for key in set(os.environ) - _BEFORE:
        del os.environ[key]
