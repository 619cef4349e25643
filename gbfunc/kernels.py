"""Import shim for source checkouts: `gbfunc.kernels` is the repository's top-level `kernels/`.

The PyPI name `kernels` belongs to another project, so the folder ships inside the wheel as
`gbfunc/kernels/` (hatch `sources` mapping in pyproject.toml, which also leaves this file
out). An editable install puts the repository root on `sys.path` instead; this module then
loads `kernels/` under the name `gbfunc.kernels` and replaces itself with it.
"""

import importlib.util
import pathlib
import sys

_FOLDER = pathlib.Path(__file__).resolve().parent.parent / "kernels"
_spec = importlib.util.spec_from_file_location(
    __name__, _FOLDER / "__init__.py", submodule_search_locations=[str(_FOLDER)]
)
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
