"""How far a weight travels through gbfunc's modules in one `gb.apply` call: the modules it
crosses, and the calls that climb back up the import graph.

    python -m benchmarks.weight_path                     # results/weight_path.md
    python -m benchmarks.weight_path --scenario eager    # one scenario (the flag repeats)
    python -m benchmarks.weight_path --json              # the measurements as JSON, on stdout

Every Python call into gbfunc's code made during one call (`gb.apply`, or a gradient through
it) is recorded with `sys.setprofile`, and read as a call tree by module; each call against
the direction of the imports (read from the source with `ast`) is a climb. The definitions
are `DEFINITIONS`, printed at the top of the output. Scenarios (`SCENARIOS`) run on the MLP
64-48-10 with two genomes (`GENOMES`), each called once before the recorded call, so that
neither compiling nor the dispatcher's first routing of a plan is recorded.
"""

import ast
import functools
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple
from unittest import mock

import torch
from torch import Tensor, nn
from torch.func import functional_call

import gbfunc as gb
from benchmarks._meta import (
    RESULTS,
    benchmark_parser,
    compile_static,
    header_md,
    markdown_table,
    provenance,
    write_results,
)
from benchmarks.bench_step import HASHED_20X

# The repository of the gbfunc imported, and the package each recorded folder is installed as
# (pyproject.toml's package-dir: `kernels/` is `gbfunc.kernels`).
ROOT = Path(gb.__file__).resolve().parents[1]
PACKAGES = {"gbfunc": "gbfunc", "kernels": "gbfunc.kernels"}

# Modules that describe and answer, with no choice of how a weight is made: left out of the
# second view of each way (their frames then count as torch's do, see DEFINITIONS).
LEAF_UTILITIES = {
    "gbfunc._plan": "the plan's frozen dataclasses: their properties (tile counts, shapes)",
    "gbfunc._genome": "the g-net's shapes and position codes, read by the plan's properties",
    "gbfunc._tree": "the gparams pytree's type and its trainable leaves",
    "gbfunc._numbers": "what counts as a number in an argument",
    "gbfunc._tracing": "what torch does to the call (export, transforms, autocast)",
    "gbfunc.cpu._mode": "the CPU loops' mode in force and whether a build failed (the memo's key)",
}

DEFINITIONS = (
    "Recorded: every Python function call (`sys.setprofile` call events; C functions are not "
    "seen) made during the measured call whose code lies in the repository's `gbfunc/` or "
    "`kernels/`. A frame's module is its file's path there, dotted, `kernels/` as installed "
    "(`gbfunc.kernels`), an `__init__.py` as its package.",
    "Caller: of a recorded call, the nearest recorded frame below it on the stack. Calls made "
    "through torch (an `autograd.Function`, `functional_call`) are the gbfunc frame's that "
    "made them; `gb.apply` itself, and a backward the autograd engine runs, come from "
    "outside.",
    "Entry: a call into a module other than its caller's (calls within a module are not "
    "steps). Chain: the entries as a call tree by module: `a(b c)` is `a` entered, and from "
    "it `b`, then `c`; `x×n` is n entries in a row of the same tree, `[x y]×n` of the same "
    "run of trees; ` | ` separates entries from outside. Module names are shown without "
    "`gbfunc.`.",
    "Modules crossed: the distinct modules of the chain. Entries per module: how many times "
    "each is entered.",
    "Imports: read from the source with `ast`, every import statement (in functions and "
    "under TYPE_CHECKING too; relative ones resolved). `from p import x` imports `p.x` where "
    "that is a module, else `p`. A imports B when a run of such imports leads from A to B.",
    "Climb (↑ in the chain): an entry from module B into a module A that imports B, a call "
    "against the direction of the imports (a callback, or an upper module's object called "
    "from below); each is listed as `B → A (function)` with the imports from A to B. "
    "Sideways: an entry between two modules neither of which imports the other.",
    "Excluding leaf utilities (`LEAF_UTILITIES`): their frames are not recorded, so that a "
    "call from one is its caller's, and entries into them are not steps.",
    "Paths as units (`PATH_UNITS`), the third view, after leaving leaf utilities out: a "
    "path's module in `gbfunc/generate/` and the package of native code it drives count as "
    "one unit, the path (the C++ loops' `gbfunc.cpu` for `cpu-loops`, the Triton kernels' "
    "`gbfunc.kernels` for `triton`, the tile MLP's bodies `generate._bodies` for `torch`), so "
    "that its runner's layers (custom op, loader, launch, bodies) are not steps; a unit "
    "imports another when one of its modules imports one of the "
    "other's. A runner's layer that two paths share (`SHARED_LAYERS`: the compile cache of "
    "`graph` and `compiled-mlp`) is the layer of the path that entered it: its frames are "
    "left out, so that its calls are that path's. The `torch` path's traced forms call the "
    "C++ loops as sub-ops: there the `cpu-loops` unit is a second path crossed.",
)

# The units of the third view: each path's module and the native package it drives.
PATH_UNITS = {
    "gbfunc.generate.torch_ops": "path torch",
    "gbfunc.generate._bodies": "path torch",
    "gbfunc.generate.cpu_loops": "path cpu-loops",
    "gbfunc.cpu": "path cpu-loops",
    "gbfunc.generate.triton": "path triton",
    "gbfunc.kernels": "path triton",
}

# The "done when" (apply → check → dispatch → one path → spec/layout).
TARGET = "at most 6 modules crossed, at most 3 climbs"


@functools.cache
def module_name(filename: str) -> str | None:
    """The dotted module of a code file in the recorded folders; None for any other file."""
    path = Path(filename).resolve()
    if not path.is_relative_to(ROOT) or path.suffix != ".py":
        return None
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    if top not in PACKAGES or not rest:
        return None
    parts = [PACKAGES[top], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Per module of the recorded folders, the gbfunc modules its source imports (read once)."""
    files = {
        module_name(str(path)): path for top in PACKAGES for path in (ROOT / top).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolved(node, package)
                found.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                )
        graph[module] = {name for name in found if name in files and name != module}
    return graph


# Runner layers that more than one path drives, each counted as the entering path's layer.
SHARED_LAYERS = {
    "gbfunc.generate._compiled": "the compile cache (compiles a path's function, runs it)",
}


def unit_of(module: str) -> str | None:
    """The unit `module` belongs to in the third view: its path's, else itself; None for a
    shared runner layer (`SHARED_LAYERS`), whose calls are those of the path entering it."""
    if module in SHARED_LAYERS:
        return None
    for prefix, unit in PATH_UNITS.items():
        if module == prefix or module.startswith(prefix + "."):
            return unit
    return module


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` between units: a unit imports the units its modules' imports reach (a shared
    layer, in no way of the third view, stands as itself)."""
    named = lambda module: unit_of(module) or module
    units: dict[str, set[str]] = {}
    for module, imported in graph.items():
        units.setdefault(named(module), set()).update(map(named, imported))
    return {unit: imported - {unit} for unit, imported in units.items()}


def _resolved(node: ast.ImportFrom, package: str) -> str:
    """The module `node` imports from, its relative form resolved from `package`."""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
    return ".".join(part for part in (base, node.module) if part)


def import_path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest run of imports from `start` to `goal`, both included; None if none."""
    before: dict[str, str | None] = {start: None}  # each module reached → the one before it
    frontier = [start]
    while frontier and goal not in before:
        reached = []
        for old in frontier:
            for new in sorted(graph.get(old, set()) - before.keys()):
                before[new] = old
                reached.append(new)
        frontier = reached
    if goal not in before:
        return None
    path = [goal]
    while (previous := before[path[-1]]) is not None:
        path.append(previous)
    return path[::-1]


class Entry(NamedTuple):
    """A call into `module`'s `function` from another module's frame: the entry `parent`
    (its index in the way), or from outside the recorded code (None)."""

    module: str
    function: str
    parent: int | None


@dataclass(frozen=True)
class Way:
    """The entries of one recorded call, in the order they were made."""

    entries: tuple[Entry, ...]

    def caller(self, entry: Entry) -> str | None:
        """The module `entry` was called from; None: from outside."""
        return None if entry.parent is None else self.entries[entry.parent].module

    @property
    def modules(self) -> list[str]:
        """The distinct modules entered, in the order first entered."""
        return list(dict.fromkeys(entry.module for entry in self.entries))

    def without(self, excluded: Collection[str]) -> "Way":
        """This way as if the frames of the `excluded` modules had not been recorded."""
        return self.relabelled(lambda module: None if module in excluded else module)

    def relabelled(self, unit: Callable[[str], str | None]) -> "Way":
        """This way with each module read as `unit(module)`: None leaves its frames out (their
        calls are their caller's), and an entry into the unit of its caller is no entry."""
        kept: list[Entry] = []
        stands_for: dict[int, int | None] = {}  # an entry → the kept entry that stands for it
        for index, entry in enumerate(self.entries):
            parent = None if entry.parent is None else stands_for[entry.parent]
            module = unit(entry.module)
            if module is None or (parent is not None and kept[parent].module == module):
                stands_for[index] = parent
            else:
                stands_for[index] = len(kept)
                kept.append(Entry(module, entry.function, parent))
        return Way(tuple(kept))


def record(call: Callable[[], object]) -> Way:
    """The way through the recorded modules of one `call()`."""
    entries: list[Entry] = []
    entry_of: dict[FrameType, int] = {}  # each live recorded frame → the entry it runs in

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event == "return":
            entry_of.pop(frame, None)
            return
        if event != "call" or (module := module_name(frame.f_code.co_filename)) is None:
            return
        outer = frame.f_back
        while outer is not None and outer not in entry_of:
            outer = outer.f_back
        parent = None if outer is None else entry_of[outer]
        if parent is not None and entries[parent].module == module:
            entry_of[frame] = parent
            return
        entry_of[frame] = len(entries)
        entries.append(Entry(module, frame.f_code.co_qualname, parent))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return Way(tuple(entries))


class Step(NamedTuple):
    """An entry read against the imports: `kind` is "outside", "down", "climb" or
    "sideways"; `imports` the run of imports that makes it so (callee to caller for a climb,
    caller to callee going down)."""

    caller: str | None
    module: str
    function: str
    kind: str
    imports: list[str] | None


def steps(way: Way, graph: dict[str, set[str]]) -> list[Step]:
    """Each entry of `way` with its kind against the import graph."""
    found = []
    for entry in way.entries:
        caller = way.caller(entry)
        if caller is None:
            kind, imports = "outside", None
        elif up := import_path(graph, entry.module, caller):
            kind, imports = "climb", up
        elif down := import_path(graph, caller, entry.module):
            kind, imports = "down", down
        else:
            kind, imports = "sideways", None
        found.append(Step(caller, entry.module, entry.function, kind, imports))
    return found


def short(module: str) -> str:
    """`module` without the `gbfunc.` prefix."""
    return module.removeprefix("gbfunc.")


def chain(way: Way, kinds: list[str]) -> str:
    """`way` as a call tree by module, repeats folded (see DEFINITIONS)."""
    children: dict[int | None, list[int]] = {}
    for index, entry in enumerate(way.entries):
        children.setdefault(entry.parent, []).append(index)

    def tree(index: int) -> str:
        name = ("↑" if kinds[index] == "climb" else "") + short(way.entries[index].module)
        inner = _folded([tree(child) for child in children.get(index, [])])
        return f"{name}({' '.join(inner)})" if inner else name

    return " | ".join(_folded([tree(root) for root in children.get(None, [])]))


def _folded(items: list[str]) -> list[str]:
    """`items` with each run of a repeated block written once, with `×n` after it."""
    out, at = [], 0
    while at < len(items):
        size, count = 1, 1
        for width in range(1, (len(items) - at) // 2 + 1):
            block, n = items[at : at + width], 1
            while items[at + n * width : at + (n + 1) * width] == block:
                n += 1
            if n > 1 and width * n > size * count:
                size, count = width, n
        text = " ".join(items[at : at + size])
        out.append(text if count == 1 else f"{text}×{count}" if size == 1 else f"[{text}]×{count}")
        at += size * count
    return out


def summary(way: Way, graph: dict[str, set[str]]) -> dict[str, Any]:
    """The numbers and lists the output shows of `way`."""
    read = steps(way, graph)
    return {
        "modules": len(way.modules),
        "entries": len(way.entries),
        "climbs": sum(step.kind == "climb" for step in read),
        "sideways": sum(step.kind == "sideways" for step in read),
        "chain": chain(way, [step.kind for step in read]),
        "entries_per_module": dict(Counter(entry.module for entry in way.entries).most_common()),
        "steps": [step._asdict() for step in read],
    }


def mlp() -> nn.Sequential:
    """The p-net: the MLP 64-48-10."""
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


GENOMES = {
    "tile 16x16": {"tile": (16, 16)},
    "hashed genome, tile full, 20x": HASHED_20X,
}


class Case(NamedTuple):
    """A scenario on one genome: the call to record, and `gb.explain` in its context."""

    call: Callable[[], object]
    explain: Callable[[], gb.Explanation]


def _loss(model: nn.Module, params: dict[str, Tensor]) -> Tensor:
    """A fixed loss of the p-net's output under `params`."""
    x = torch.linspace(-1, 1, 8 * 64).reshape(8, 64)
    return functional_call(model, params, (x,)).square().mean()


def _eager(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
    return Case(
        lambda: gb.apply(gparams, plan, compile=False),
        lambda: gb.explain(gparams, plan, compile=False),
    )


def _grad(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
    def loss(g: dict) -> Tensor:
        return _loss(model, gb.apply(g, plan, compile=False))

    def explain() -> gb.Explanation:  # as the loss's `gb.apply` sees its call
        seen = []

        def explained(g: dict) -> Tensor:
            seen.append(gb.explain(g, plan, compile=False))
            return loss(g)

        torch.func.grad(explained)(gparams)
        return seen[0]

    grad = torch.func.grad(loss)
    return Case(lambda: grad(gparams), explain)


def _compiled(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
    return Case(
        lambda: gb.apply(gparams, plan, compile=True),
        lambda: gb.explain(gparams, plan, compile=True),
    )


def _compiled_backward(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
    return Case(
        lambda: _loss(model, gb.apply(gparams, plan, compile=True)).backward(),
        lambda: gb.explain(gparams, plan, compile=True),
    )


def _torch_compile(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
    def generate(g: dict) -> dict[str, Tensor]:
        return gb.apply(g, plan)

    compiled = compile_static(generate)
    return Case(lambda: compiled(gparams), lambda: gb.explain(gparams, plan))


def _loops_off(make: Callable[[nn.Module, gb.Plan, dict], Case]) -> Callable[..., Case]:
    """`make`'s case with the CPU loops off (`$GBFUNC_CPU_LOOPS=off` during each call, so that
    the route memo's key stays one: `gb.cpu.set_mode` would make every call route anew)."""

    def off(function: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with mock.patch.dict(os.environ, {gb.cpu.MODE_VARIABLE: "off"}):
                return function()

        return call

    def made(model: nn.Module, plan: gb.Plan, gparams: dict) -> Case:
        case = make(model, plan, gparams)
        return Case(off(case.call), off(case.explain))

    return made


class Scenario(NamedTuple):
    """What is called (`what`, as the output says it), and its `Case` for a genome; `traced`:
    inside `torch.compile`, where `gb.explain` cannot be asked (it is asked eagerly)."""

    what: str
    make: Callable[[nn.Module, gb.Plan, dict], Case]
    traced: bool = False


SCENARIOS = {
    "eager": Scenario("`gb.apply(gparams, plan, compile=False)`: the torch path", _eager),
    "grad": Scenario(
        "`torch.func.grad` of a loss of `functional_call(model, gb.apply(..., compile=False), "
        "x)`: the forward and the backward",
        _grad,
    ),
    "compile": Scenario("`gb.apply(gparams, plan, compile=True)`, eager", _compiled),
    "compile-backward": Scenario(
        "the same loss of `gb.apply(..., compile=True)`, then `.backward()` (autograd: "
        "`torch.func` transforms keep compiled paths off)",
        _compiled_backward,
    ),
    "compile, loops off": Scenario(
        "`gb.apply(gparams, plan, compile=True)`, eager, with `GBFUNC_CPU_LOOPS=off` (as "
        "where the loops cannot be built: no C++ compiler, not Linux x86-64)",
        _loops_off(_compiled),
    ),
    "torch.compile": Scenario(
        "`torch.compile(fullgraph=True)` of a function calling `gb.apply(gparams, plan)`: "
        "the compiled code runs, gbfunc's Python only where it is called from it; the route "
        "shown is `gb.explain`'s eagerly (inside, the trace decided)",
        _torch_compile,
        traced=True,
    ),
}


def route_line(explanation: gb.Explanation) -> str:
    """`gb.explain`'s context, plan path and each stack's path, in one line."""
    context, plan_path, *stacks = explanation.lines
    taken = [line for line in stacks if not line.startswith(" ")]
    return "; ".join([context, plan_path.split(";")[0], *taken])


def paths(explanation: gb.Explanation) -> str:
    """The plan's path and its stacks', short: `stacks: torch (eager-recompute)×2`."""
    route = explanation.route
    taken = [f"{path} ({form})" for path, form in zip(route.stacks, route.variants, strict=True)]
    return f"{route.plan}: {' '.join(_folded(taken))}"


def measure(genome: str, scenario: str) -> dict[str, Any]:
    """Record `scenario` on `genome` (after one call), both views summarised."""
    torch.manual_seed(0)
    model = mlp()
    plan = gb.plan(model, **GENOMES[genome])
    case = SCENARIOS[scenario].make(model, plan, gb.init(plan, seed=0))
    case.call()
    way = record(case.call)
    left = way.without(LEAF_UTILITIES)
    graph = import_graph()
    explanation = case.explain()
    return {
        "genome": genome,
        "scenario": scenario,
        "call": SCENARIOS[scenario].what,
        "route": route_line(explanation),
        "paths": ("eagerly " if SCENARIOS[scenario].traced else "") + paths(explanation),
        "all": summary(way, graph),
        "excluding_leaf_utilities": summary(left, graph),
        "paths_as_units": summary(left.relabelled(unit_of), unit_graph(graph)),
    }


VIEWS = {
    "all": "all modules",
    "excluding_leaf_utilities": "excluding leaf utilities",
    "paths_as_units": "paths as units",
}


def report(rows: list[dict[str, Any]]) -> str:
    """The markdown results: definitions, a summary table, then each scenario's way."""
    leaves = ", ".join(f"`{name}` ({why})" for name, why in LEAF_UTILITIES.items())
    text = "## Definitions\n\n" + "".join(f"- {line}\n" for line in DEFINITIONS)
    units = ", ".join(f"`{module}` in {unit}" for module, unit in PATH_UNITS.items())
    shared = ", ".join(f"`{name}` ({why})" for name, why in SHARED_LAYERS.items())
    text += f"- Leaf utilities: {leaves}.\n- Path units: {units}.\n- Shared layers: {shared}.\n"
    text += f"- The issue's target: {TARGET}.\n\n## Summary\n\n"
    columns = [("genome", "l"), ("scenario", "l"), ("stacks' paths", "l")] + [
        (f"{title} ({view})", "r")
        for view in ("all", "leaves out", "units")
        for title in ("modules", "climbs")
    ]
    text += markdown_table(
        columns,
        (
            [row["genome"], row["scenario"], row["paths"]]
            + [str(row[view][key]) for view in VIEWS for key in ("modules", "climbs")]
            for row in rows
        ),
    )
    return text + "".join(_section(row) for row in rows)


def _section(row: dict[str, Any]) -> str:
    """One scenario's way: its numbers, chains, climbs and entries per module."""
    keys = ("modules", "entries", "climbs", "sideways")
    text = f"\n## {row['genome']}: {row['scenario']}\n\n"
    text += f"- call: {row['call']}\n- route (`gb.explain`): {row['route']}\n\n"
    text += markdown_table(
        [("view", "l"), *((key, "r") for key in keys)],
        ([title, *(str(row[view][key]) for key in keys)] for view, title in VIEWS.items()),
    )
    text += "\n" + "".join(
        f"- chain, {title}: `{row[view]['chain']}`\n" for view, title in VIEWS.items()
    )
    for kind, title in (("climb", "climbs"), ("sideways", "sideways")):
        listed = [_step_line(step) for step in row["all"]["steps"] if step["kind"] == kind]
        text += f"- {title}:" + ("".join(f"\n  - {line}" for line in listed) or " none") + "\n"
    counts = row["all"]["entries_per_module"].items()
    return text + "- entries per module: " + ", ".join(f"{short(m)} {n}" for m, n in counts) + "\n"


def _step_line(step: dict[str, Any]) -> str:
    """`B → A (function)`, and the imports that make it a climb (A's to B) if any."""
    line = f"{short(step['caller'])} → {short(step['module'])} ({step['function']})"
    imports = step["imports"]
    return line + (f": imports {' → '.join(map(short, imports))}" if imports else "")


def main() -> None:
    parser = benchmark_parser(__doc__, json="print the measurements as JSON, write no file")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=RESULTS / "weight_path.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(genome, name) for genome in GENOMES for name in args.scenario or SCENARIOS]
    if args.json:
        body = {
            "provenance": provenance(),
            "definitions": DEFINITIONS,
            "leaf_utilities": LEAF_UTILITIES,
            "path_units": PATH_UNITS,
            "shared_layers": SHARED_LAYERS,
            "rows": rows,
        }
        print(json.dumps(body, indent=1, ensure_ascii=False))
        return
    text = header_md("How far a weight travels in one gb.apply call") + "\n" + report(rows)
    print(text)
    write_results(args.out, text)


if __name__ == "__main__":
    main()
