"""Generating regions of parameters: which tiles cover a region, and laying them out.

The one path from g-nets to parameters. `gb.apply` is `Selection.whole(plan)`: every
parameter, whole. A tensor-parallel rank selects its shard of each weight, a pipeline stage
its own layers; both evaluate just the tiles under those regions, one batched call per stack.
A tile that straddles a region's edge is generated whole and cut.
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._condition import condition_of, conditioned
from ._dispatch import Route, context_of, stack_path
from ._plan import Free, Generated, Plan, Stack, plan_of, token_of
from ._realised import realised
from ._tilemlp_forward import EAGER
from ._tiling import (
    Concat,
    Piece,
    Region,
    full_region,
    lay_out,
    parameters,
    piece_tiles,
    pieces,
)
from ._tree import GParams
from .cpu import Placement, placement
from .generate import compiled_mlp, cpu_loops, graph, torch_ops, triton


@torch.compiler.assume_constant_result
def stack_placement(token: str, s: int) -> Placement | None:
    """`cpu.placement` of stack `s` of the plan with this `token`, all its parameters whole.
    Run in Python where `torch.compile` traces it, not traced: its loops run per tile, and
    dynamo tracing them took a third of a two-layer GPT-2 step's compile (2,796 tiles)."""
    plan = plan_of(token)
    return placement(plan.stacks[s], [p for p in plan.generated if p.stack_index == s])


Parts = tuple[tuple[str, tuple[tuple[Region, ...], int]], ...]  # per name: regions, dim
Rows = slice | list[int]  # a piece's rows in the evaluated tiles: a slice where consecutive


class _Layout(NamedTuple):
    """Where a selection's tiles come from and go, fixed by the plan and the regions: per
    stack the tiles evaluated (ascending), per `(name, region index)` the pieces that cover
    the region and each piece's rows in the evaluated tiles, and per stack its split
    (`_partition`). As `(key, value)` pairs, not dicts: dynamo cannot iterate a dict that
    `torch.compiler.assume_constant_result` returned (it would guard on its keys)."""

    tiles: tuple[tuple[int, list[int]], ...]
    pieces: tuple[tuple[tuple[str, int], list[Piece]], ...]
    rows: tuple[tuple[tuple[str, int], list[Rows]], ...]
    splits: tuple[tuple[int, list[tuple[int, int]] | None], ...]


def _layout(plan: Plan, parts: Parts) -> _Layout:
    """The `_Layout` of `parts` (each selected parameter's regions and their dim) of `plan`:
    Python loops over tiles, run once per selection."""
    params = {p.name: p for p in plan.params}
    needed: dict[int, set[int]] = {}
    covering: dict[tuple[str, int], list[Piece]] = {}
    for name, (regions, _) in parts:
        p = params[name]
        if isinstance(p, Generated):
            stack = plan.stacks[p.stack_index]
            for k, region in enumerate(regions):
                found = covering[name, k] = pieces(p, stack, region)
                tiles = (t for piece in found for t in piece_tiles(p, piece))
                needed.setdefault(p.stack_index, set()).update(tiles)
    evaluated = {s: sorted(t) for s, t in sorted(needed.items())}
    position = {s: {t: i for i, t in enumerate(tiles)} for s, tiles in evaluated.items()}
    rows: dict[tuple[str, int], list[Rows]] = {}
    for (name, k), found in covering.items():
        p = params[name]
        rows[name, k] = []
        for piece in found:
            at = [position[p.stack_index][t] for t in piece_tiles(p, piece)]
            consecutive = at == list(range(at[0], at[0] + len(at)))
            rows[name, k].append(slice(at[0], at[0] + len(at)) if consecutive else at)
    of_stack = {s: [] for s in evaluated}
    for (name, _), covering_rows in rows.items():
        of_stack[params[name].stack_index].extend(covering_rows)
    splits = {s: _partition(of_stack[s], len(evaluated[s])) for s in evaluated}
    return _Layout(*(tuple(d.items()) for d in (evaluated, covering, rows, splits)))


@torch.compiler.assume_constant_result
def _whole_layout(token: str) -> _Layout:
    """`_layout` of every parameter, whole, of the plan with this `token`, run in Python
    where `torch.compile` traces it, not traced: traced, its loops over tiles took dynamo
    ~10 s of each compile of a two-layer GPT-2 (2,796 tiles), and reading the result as
    Python data another ~15. Only the token goes in: dynamo may make the plan's shapes
    symbolic, which a constant function cannot take."""
    plan = plan_of(token)
    return _layout(plan, tuple((p.name, ((full_region(p.shape),), 0)) for p in plan.params))


def _partition(rows: list[Rows], evaluated: int) -> list[tuple[int, int]] | None:
    """The row ranges of a stack's `evaluated` tiles that its pieces read (`rows`), where
    they are consecutive ranges that cover every row once (a whole plan's blocks): split
    (traced: taken apart out of the tile MLP), not sliced."""
    if not all(isinstance(r, slice) for r in rows):
        return None
    ordered = sorted({(r.start, r.stop) for r in rows})
    stops = [0] + [stop for _, stop in ordered]
    covers = [start for start, _ in ordered] == stops[:-1] and stops[-1] == evaluated
    return ordered if covers else None


class Selection:
    """Generate `regions` of some parameters of `plan`, evaluating only the tiles under them.

    Args:
        plan: The model's plan.
        regions: `{name: region or Concat}` for the parameters to produce (generated or
            free).
        _layout_found: Their `_Layout`, where it was computed already (the whole plan's,
            outside a trace: `_whole_layout`); None computes it here.

    Attributes:
        regions: The regions asked for, by parameter name.
        tiles: `{stack index: tile indices}` that `apply` evaluates.

    Examples:
        >>> model = nn.ModuleDict({"fc": nn.Linear(128, 256)})
        >>> plan = gb.plan(model, tile=(32, 32))
        >>> # the first 64 rows
        >>> sel = Selection(plan, {"fc.weight": ((0, 64), (0, 128))})
        >>> sel.apply(gb.init(plan))["fc.weight"].shape
        torch.Size([64, 128])
    """

    def __init__(
        self,
        plan: Plan,
        regions: Mapping[str, Region | Concat],
        *,
        _layout_found: _Layout | None = None,
    ) -> None:
        params = {p.name: p for p in plan.params}
        self._parts = {name: _parts(region) for name, region in regions.items()}
        for name, (parts, _) in self._parts.items():
            for region in parts:
                _check_region(params.get(name), name, region)
        self.plan = plan
        self.regions = dict(regions)
        self._params = {name: params[name] for name in regions}
        layout = _layout_found or _layout(plan, tuple(self._parts.items()))
        self.tiles = dict(layout.tiles)  # per stack, the tiles evaluated
        self._pieces, self._rows = dict(layout.pieces), dict(layout.rows)
        self._splits = dict(layout.splits)
        self._views = True  # free parameters as views; `whole` hands out the leaves
        self._index: dict[tuple[str, int, torch.device], list[Tensor]] = {}
        self._placements = {s: self._placement(s) for s in self.tiles}

    @staticmethod
    def whole(plan: Plan) -> "Selection":
        """Every parameter of `plan`, whole, in plan order: what `gb.apply` generates."""
        if not torch.compiler.is_compiling():
            return _cached_whole(plan)
        token = token_of(plan)  # None: a plan made inside the traced function, traced as it is
        return _whole_plan(plan, None if token is None else _whole_layout(token))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def generated(plan: Plan) -> "Selection":
        """Every generated parameter of `plan`, whole: what the `graph` path compiles."""
        return Selection(plan, {p.name: full_region(p.shape) for p in plan.generated})

    @property
    def num_tiles(self) -> int:
        """Tiles evaluated per call."""
        return sum(len(t) for t in self.tiles.values())

    def apply(
        self,
        gparams: GParams,
        *,
        condition: Tensor | None = None,
        task: int | Tensor | None = None,
        compile: bool | None = False,
        paths: Sequence[str] | None = None,
        route: Route | None = None,
    ) -> dict[str, Tensor]:
        """`{name: tensor of the region's shape}` for every selected parameter (differentiable).

        Each stack runs its path's runner (`gbfunc.generate`) in the path's variant: as
        `route` (a whole plan's, from `gb.apply`; `graph` there means its compile failed: op
        by op) has them, else as the dispatcher chooses them here, with `compile` as
        `gb.apply`'s (`paths`, per stack of the plan: the paths to take). A conditioned plan
        takes `condition` or `task` as `gb.apply` does.
        """
        if self.plan.condition or condition is not None or task is not None:
            z = condition_of(gparams, self.plan, condition, task, "the selection's apply")
            if z is not None:
                gparams, _ = conditioned(gparams, self.plan, z)
        tiles, direct = {}, {}
        context = None
        for s, indices in self.tiles.items():
            stack = self.plan.stacks[s]
            leaves = gparams["stacks"][stack.key]
            if route is not None:
                path, form, traced = route.stacks[s], route.variants[s], route.traced
            else:
                if context is None:
                    context = context_of(gparams["stacks"], backend="torch", compile=compile)
                placed = self._placements[s] is not None
                asked = None if paths is None else paths[s]
                path, form = stack_path(stack, leaves, context, placed=placed, path=asked)
                traced = context.compiling
            if path == cpu_loops.NAME:
                names, where = self._placements[s]
                weights = cpu_loops.generate(stack, leaves, where, form)
                direct.update(zip(names, weights, strict=True))
                continue
            if path == triton.NAME:  # a whole plan's stack, beside stacks the kernels refused
                direct.update(triton.stack_weights(self.plan, s, leaves, traced))
                continue
            if path == graph.NAME:  # its compile failed: op by op, eagerly
                path, form = torch_ops.NAME, EAGER
            runner = compiled_mlp if path == compiled_mlp.NAME else torch_ops
            spans = self._splits[s]
            if spans is not None and _parts_from_tile_mlp(stack) and traced:
                # Traced, the parts come apart out of the tile MLP: the backward then never
                # assembles the stack's gradient (`tile_mlp`).
                parts = runner.tiles(stack, leaves, indices, spans, form=form)
                tiles[s] = dict(zip(spans, parts, strict=True))
                continue
            (evaluated,) = runner.tiles(stack, leaves, indices, None, form=form)
            tiles[s] = self._split(s, evaluated)
        generated = {
            p.name: direct[p.name].reshape(p.shape)
            if p.name in direct
            else self._laid_out(p, tiles)
            for p in self._params.values()
            if isinstance(p, Generated)
        }
        params = parameters(self._params.values(), gparams, generated)
        if not self._views:
            return params
        return {
            name: value if name in generated else self._cut(self._params[name], value)
            for name, value in params.items()
        }

    def _laid_out(self, p: Generated, tiles: dict[int, dict[object, Tensor]]) -> Tensor:
        """Generated `p`'s selection from its stack's evaluated `tiles`; traced, computed into a
        buffer of its own (`realised`: eagerly the weight itself, so not called)."""
        weight = self._join(p, lambda k, region: self._lay_out(p, k, region, tiles))
        return realised(weight) if torch.compiler.is_compiling() else weight

    def _join(self, p: Generated | Free, part: Callable[[int, Region], Tensor]) -> Tensor:
        """`part(k, region)` for each region of `p`'s selection, joined along its dim."""
        regions, dim = self._parts[p.name]
        values = [part(k, region) for k, region in enumerate(regions)]
        return values[0] if len(values) == 1 else torch.cat(values, dim=dim)

    def _cut(self, p: Free, value: Tensor) -> Tensor:
        """A view of free `value` cut to `p`'s regions (even when whole: a tensor-parallel
        rank's gradient hooks on it must not reach the leaf)."""
        return self._join(p, lambda k, region: value[tuple(slice(a, b) for a, b in region)])

    def _placement(self, s: int) -> tuple[list[str], Placement] | None:
        """Where stack `s`'s tiles land, for the CPU loops, where its g-nets suit them and
        the selection takes every parameter of the stack whole."""
        params = [p for p in self.plan.generated if p.stack_index == s]
        whole = all(
            p.name in self._params and self._parts[p.name][0] == (full_region(p.shape),)
            for p in params
        )
        token = token_of(self.plan)
        if not whole:
            where = None
        elif token is None:  # a plan made inside the traced function: traced as it is
            where = placement(self.plan.stacks[s], params)
        else:
            where = stack_placement(token, s)
        return None if where is None else ([p.name for p in params], where)

    def _split(self, s: int, stack_tiles: Tensor) -> dict[tuple[int, int] | None, Tensor]:
        """Stack `s`'s tiles (key None) and, where `_partition` found one, its split parts.

        A split's backward is one concatenation; slicing the stack once per parameter makes a
        zero-filled stack-sized gradient per slice and adds them up. Traced, `apply` takes the
        parts from the tile MLP instead.
        """
        parts: dict[tuple[int, int] | None, Tensor] = {None: stack_tiles}
        spans = self._splits[s]
        if spans is not None:
            sizes = [stop - start for start, stop in spans]
            split = stack_tiles.split(sizes) if len(sizes) > 1 else (stack_tiles,)
            parts.update(zip(spans, split, strict=True))
        return parts

    def _lay_out(
        self, p: Generated, k: int, region: Region, tiles: dict[int, dict[object, Tensor]]
    ) -> Tensor:
        split = tiles[p.stack_index]
        device = next(iter(split.values())).device
        parts = [_rows_of(split, rows) for rows in self._indices(p.name, k, device)]
        stack = self.plan.stacks[p.stack_index]
        return lay_out(p, stack, region, self._pieces[p.name, k], parts)

    def _indices(self, name: str, k: int, device: torch.device) -> list[slice | Tensor]:
        rows = self._rows[name, k]
        if all(isinstance(r, slice) for r in rows):
            return rows  # nothing cached, so a compiled caller's guards stay valid
        key = (name, k, device)
        if key not in self._index:
            self._index[key] = [
                rows if isinstance(rows, slice) else torch.tensor(rows, device=device)
                for rows in self._rows[name, k]
            ]
        return self._index[key]


def _parts_from_tile_mlp(stack: Stack) -> bool:
    """Whether traced code takes a split stack's parts out of its tile MLP (`tile_mlp`'s
    `spans`), rather than splitting the MLP's output: all but row g-nets (one evaluation per
    tile row, `Q == 1`). Their hidden activations are a tile row's `H` values, so there is
    little for the parts to free early, and per part their backward runs more, smaller batched
    matmuls: taken apart, their compiled steps were slower for little memory saved. Only the
    largest model measured favoured the parts (`benchmarks/scaling.py`'s transformer at width
    1024)."""
    return stack.columns > 1


def _rows_of(split: dict[tuple[int, int] | None, Tensor], rows: slice | Tensor) -> Tensor:
    """Rows `rows` of a stack's evaluated tiles (key None), from its parts where one is
    exactly those rows."""
    if isinstance(rows, Tensor):
        return split[None].index_select(0, rows)
    part = split.get((rows.start, rows.stop))
    return split[None][rows] if part is None else part


def _parts(region: Region | Concat) -> tuple[tuple[Region, ...], int]:
    """The regions of a selection entry and the dim they are joined along."""
    return (region.regions, region.dim) if isinstance(region, Concat) else ((region,), 0)


def _check_region(p: Generated | Free | None, name: str, region: Region) -> None:
    if p is None:
        raise ValueError(f"gb.dist: {name!r} is not a parameter of the plan.")
    ok = len(region) == len(p.shape) and all(
        (a, b) == (0, n) or 0 <= a < b <= n for (a, b), n in zip(region, p.shape, strict=True)
    )
    if not ok:
        raise ValueError(f"gb.dist: region {region} does not fit {name} of shape {p.shape}.")
    whole_rows = all(r == (0, n) for r, n in zip(region[1:], p.shape[1:], strict=True))
    if getattr(p, "center", False) and not whole_rows:
        raise ValueError(
            f"gb.dist: {name} has center=True, which needs whole rows, but region "
            f"{region} splits its columns; shard it by rows or plan it without center."
        )


def _whole_plan(plan: Plan, layout: _Layout | None = None) -> Selection:
    """Every parameter of `plan`, whole, the leaves themselves for free ones; `layout`: its
    `_Layout`, computed already (outside a trace)."""
    regions = {p.name: full_region(p.shape) for p in plan.params}
    selection = Selection(plan, regions, _layout_found=layout)
    selection._views = False
    return selection


_cached_whole = functools.lru_cache(maxsize=64)(_whole_plan)
