"""gbfunc: the genomic bottleneck as pure functions.

Small MLPs (g-nets) generate the weights of a model (the p-net) tile by tile; only the
g-nets are trained and stored.

    plan = gb.plan(model, tile=(64, 64))
    gparams = gb.init(plan, seed=0)
    params = gb.apply(gparams, plan)
    out = torch.func.functional_call(model, params, (x,))
"""

from . import (
    _environ,  # first: it notes the environment before the modules below load
    compat as compat,
    continual as continual,
    cpu as cpu,
    memory as memory,
    optim as optim,
)
from ._apply import apply as apply
from ._calibrate import calibrate as calibrate
from ._checkpoint import (
    Checkpoint as Checkpoint,
    CheckpointCorruptError as CheckpointCorruptError,
    CheckpointError as CheckpointError,
    CheckpointMismatchError as CheckpointMismatchError,
    CheckpointNotFoundError as CheckpointNotFoundError,
    CheckpointUnreadableError as CheckpointUnreadableError,
    CheckpointVersionError as CheckpointVersionError,
    load as load,
    save as save,
)
from ._dispatch import Explanation as Explanation, explain as explain
from ._export import export as export, save_dense as save_dense
from ._fit import Fitted as Fitted, fit as fit, train_alternating as train_alternating
from ._genome import Genome as Genome
from ._init import init as init
from ._module import Bottleneck as Bottleneck
from ._plan import (
    Free as Free,
    Generated as Generated,
    Plan as Plan,
    Stack as Stack,
)
from ._planner import plan as plan
from ._report import Report as Report, report as report
from ._rules import Layout as Layout, register_rule as register_rule
from ._tree import trainable_leaves as trainable_leaves
from ._version import __version__ as __version__

_environ.restore()  # what torch._dynamo's import wrote (see gbfunc/_environ.py)


def __getattr__(name: str) -> object:
    """`gb.dist`, imported on first use (docstrings and messages name it so), as
    `import gbfunc.dist` imports it."""
    if name == "dist":
        import importlib  # here, not at the top: `gb.importlib` would be public

        return importlib.import_module(".dist", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The public API: each name has an entry in docs/api/gbfunc.md (tests/test_docs.py).
__all__ = [
    "Bottleneck",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointUnreadableError",
    "CheckpointVersionError",
    "Explanation",
    "Fitted",
    "Free",
    "Generated",
    "Genome",
    "Layout",
    "Plan",
    "Report",
    "Stack",
    "apply",
    "calibrate",
    "compat",
    "continual",
    "cpu",
    "explain",
    "export",
    "fit",
    "init",
    "load",
    "memory",
    "optim",
    "plan",
    "register_rule",
    "report",
    "save",
    "save_dense",
    "train_alternating",
    "trainable_leaves",
]
