"""Importing gbfunc leaves `os.environ` as it found it.

`torch.compiler`'s decorators on gbfunc's functions import `torch._dynamo`, whose import
writes `TORCHINDUCTOR_CACHE_DIR` (torch's `cache_dir()`). torch writes it again whenever it
next needs its cache, so removing it, where the import added it, changes nothing for torch and
keeps the variable out of the environment other libraries and child processes see. Only that
variable: another thread may set others while gbfunc imports, and they are not gbfunc's.
"""

import os

# What `import torch._dynamo` writes; checked before gbfunc's modules load (gbfunc/__init__.py
# imports this module first).
_WRITTEN_BY_IMPORT = ("TORCHINDUCTOR_CACHE_DIR",)
_ADDED = tuple(key for key in _WRITTEN_BY_IMPORT if key not in os.environ)


def restore() -> None:
    """Remove what `import torch._dynamo` added to `os.environ` during gbfunc's import."""
    for key in _ADDED:
        os.environ.pop(key, None)
