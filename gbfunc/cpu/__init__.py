"""The CPU fast path: C++ loops for one-layer ReLU g-nets and hashed tables, optional.

Each loop (`csrc/*.cpp`) sits beside its pure-torch specification (`_relu_loops`,
`_relu_rows`, `_relu_tiles`, `_hash_weights`, `_hash_gradient`), runs as a custom op with
fake, vmap and autograd rules, and is built on first use into a private per-user cache
(`_build`, `_cache`). Which stacks take the loops from leaves to weights is decided in one
place, `gbfunc._dispatch`, by the `cpu-loops` path's rule (`gbfunc.generate.cpu_loops`),
which asks `refusal`; a stack taken runs through `weights` (and `add_hash` for a hashed
table) where `placement` says its weights land. `gb.explain` shows the decision. The loops
that serve as sub-ops of the `torch` path's traced forms are chosen with the form
(`generate._traced_forms.forward_form`, which `gb.explain` names too), and the backward's
sums and the hashed tables' gradient where their own predicates hold (`_relu_loops.sums_usable`,
`_hash_gradient.usable`).

`GBFUNC_CPU_LOOPS=off|portable|auto` (or `set_mode`; the mode in force is `_mode`'s) chooses
whether and how they are built; without a C++ compiler, on other platforms, or with `off`,
every call runs through pure torch with the same results, to rounding.
"""

from ._build import compiler, missing_compiler, unavailable_reason
from ._cache import CACHE_VARIABLE, cache_root
from ._hash_weights import generate as add_hash
from ._mode import MODE_VARIABLE, MODES, loops_state, mode, set_mode
from ._relu_rows import Placement, generate as weights
from ._stacks import placement, refusal

__all__ = [
    "CACHE_VARIABLE",
    "MODES",
    "MODE_VARIABLE",
    "Placement",
    "add_hash",
    "cache_root",
    "compiler",
    "loops_state",
    "missing_compiler",
    "mode",
    "placement",
    "refusal",
    "set_mode",
    "unavailable_reason",
    "weights",
]
