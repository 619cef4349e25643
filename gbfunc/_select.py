"""Generating regions of parameters: which tiles cover a region, and laying them out.

`gbfunc.dist`'s way from g-nets to parameters (`gb.apply` runs each stack's runner itself).
A tensor-parallel rank selects its shard of each weight, a pipeline stage its own layers;
both evaluate just the tiles under those regions, one batched call per stack, and a stack
whose parameters are all selected whole runs its path's runner for a whole plan. A tile that
straddles a region's edge is generated whole and cut.
"""

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ._check_gparams import check_gparams
from ._condition import folded
from ._dispatch import context_of, runner, stack_path
from ._numbers import as_integer
from ._plan import Free, Generated, Plan, check_is_plan
from ._realised import realised
from ._tiling import (
    Concat,
    Piece,
    Region,
    full_region,
    lay_out,
    parameters,
    partition,
    piece_tiles,
    pieces,
    split_into,
)
from ._tracing import autocast_off
from ._tree import GParams, first_leaf
from .generate import cpu_loops, torch_ops

Rows = slice | list[int]  # a piece's rows in the evaluated tiles: a slice where consecutive


class Selection:
    """Generate `regions` of some parameters of `plan`, evaluating only the tiles under them.

    Args:
        plan: The model's plan.
        regions: `{name: region or Concat}` for the parameters to produce (generated or
            free).

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

    def __init__(self, plan: Plan, regions: Mapping[str, Region | Concat]) -> None:
        check_is_plan(plan, "gb.dist.Selection")
        if not isinstance(regions, Mapping):
            raise TypeError(
                f"gb.dist: regions must be a dict {{name: region or Concat}}, got "
                f"{type(regions).__name__}."
            )
        params = {p.name: p for p in plan.params}
        regions = {name: _checked(params.get(name), name, r) for name, r in regions.items()}
        self._parts = {name: _parts(region) for name, region in regions.items()}
        self.plan = plan
        self.regions = regions
        self._params = {name: params[name] for name in regions}
        self._index: dict[tuple[str, int, torch.device], list[Tensor]] = {}
        # The stacks whose parameters are all selected whole: generated as `gb.apply` does,
        # and of those the ones the loops may write (`cpu-loops`: none centred).
        selected = {p.stack_index for p in self._params.values() if isinstance(p, Generated)}
        self._whole = {s for s in selected if self._whole_stack(s)}
        self._placed = {s for s in self._whole if cpu_loops.placement_of(plan, s) is not None}
        # The tiles evaluated per stack (ascending): a whole stack's every tile; for the
        # others, per `(name, region index)`, the pieces that cover the region and each
        # piece's rows in the evaluated tiles, and the stack's split where they make one.
        needed: dict[int, set[int]] = {s: set(range(plan.stacks[s].num_tiles)) for s in self._whole}
        self._pieces: dict[tuple[str, int], list[Piece]] = {}
        for name, p in self._params.items():
            if isinstance(p, Generated) and p.stack_index not in self._whole:
                stack = plan.stacks[p.stack_index]
                for k, region in enumerate(self._parts[name][0]):
                    covering = self._pieces[name, k] = pieces(p, stack, region)
                    tiles = (t for piece in covering for t in piece_tiles(p, piece))
                    needed.setdefault(p.stack_index, set()).update(tiles)
        self.tiles = {s: sorted(t) for s, t in sorted(needed.items())}
        position = {s: {t: i for i, t in enumerate(tiles)} for s, tiles in self.tiles.items()}
        self._rows = {
            key: self._tile_rows(key, position[self._params[key[0]].stack_index])
            for key in self._pieces
        }
        self._splits = {s: self._partition(s) for s in self.tiles if s not in self._whole}

    @staticmethod
    def whole(plan: Plan) -> "Selection":
        """Every parameter of `plan`, whole, in plan order (free ones as views)."""
        return Selection(plan, {p.name: full_region(p.shape) for p in plan.params})

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
        where: str = "gb.dist.Selection.apply",
    ) -> dict[str, Tensor]:
        """`{name: tensor of the region's shape}` for every selected parameter (differentiable).

        Each stack runs the runner of the path the dispatcher chooses for it here, with
        `compile` as `gb.apply`'s (`paths`, per stack of the plan: the paths to take): a stack
        whose parameters are all selected whole, its path's runner for a whole plan (so the
        C loops may write them); the others, the tiles under their regions. A conditioned plan
        takes `condition` or `task` as `gb.apply` does; `where` names the call in its errors.
        """
        check_gparams(gparams, self.plan, where)  # the loops trust the plan's tile counts
        with autocast_off(first_leaf(gparams["stacks"])):  # as `gb.apply`: in the g-nets' dtype
            gparams, _ = folded(gparams, self.plan, condition, task, where)
            return self._generate(gparams, compile, paths)

    def _generate(
        self, gparams: GParams, compile: bool | None, paths: Sequence[str] | None
    ) -> dict[str, Tensor]:
        """`apply`'s work once the condition is folded in."""
        context = context_of(gparams["stacks"], backend="torch", compile=compile)
        tiles, whole = {}, {}
        for s, indices in self.tiles.items():
            stack = self.plan.stacks[s]
            leaves = gparams["stacks"][stack.key]
            asked = None if paths is None else paths[s]
            placed = s in self._placed
            path, form = stack_path(stack, leaves, context, placed=placed, path=asked)
            if s in self._whole:  # as `gb.apply` generates them
                runs = runner(path).stack_weights
                whole.update(runs(self.plan, s, leaves, form, context.compiling))
                continue
            tiles_of = runner(path).tiles  # the `torch` or `compiled-mlp` path
            spans = self._splits[s]
            if spans is not None and torch_ops.parts_from_tile_mlp(stack) and context.compiling:
                # Traced, the parts come apart out of the tile MLP: the backward then never
                # assembles the stack's gradient (`tile_mlp`).
                parts = tiles_of(stack, leaves, indices, spans, form=form)
                tiles[s] = dict(zip(spans, parts, strict=True))
                continue
            (evaluated,) = tiles_of(stack, leaves, indices, None, form=form)
            tiles[s] = self._split(s, evaluated)
        generated = {
            p.name: whole[p.name]
            if p.name in whole
            else self._laid_out(p, tiles, context.compiling)
            for p in self._params.values()
            if isinstance(p, Generated)
        }
        params = parameters(self._params.values(), gparams, generated)
        return {
            name: value if name in generated else self._cut(self._params[name], value)
            for name, value in params.items()
        }

    def _whole_stack(self, s: int) -> bool:
        """Whether every parameter of stack `s` is selected, whole."""
        return all(
            p.name in self._params and self._parts[p.name][0] == (full_region(p.shape),)
            for p in self.plan.generated_by(s)
        )

    def _tile_rows(self, key: tuple[str, int], position: Mapping[int, int]) -> list[Rows]:
        """The rows of each piece of `key` in its stack's evaluated tiles (`position`: each
        tile's row there, built once per stack): a slice where they are consecutive."""
        p = self._params[key[0]]
        rows: list[Rows] = []
        for piece in self._pieces[key]:
            at = [position[t] for t in piece_tiles(p, piece)]
            consecutive = at == list(range(at[0], at[0] + len(at)))
            rows.append(slice(at[0], at[0] + len(at)) if consecutive else at)
        return rows

    def _partition(self, s: int) -> list[tuple[int, int]] | None:
        """The row ranges of stack `s`'s evaluated tiles that the pieces read, where they are
        consecutive and cover every row once (`partition`): split, not sliced."""
        rows_of_stack = [
            rows
            for (name, _), covering in self._rows.items()
            if self._params[name].stack_index == s
            for rows in covering
        ]
        if not all(isinstance(rows, slice) for rows in rows_of_stack):
            return None
        return partition([(r.start, r.stop) for r in rows_of_stack], len(self.tiles[s]))

    def _laid_out(
        self, p: Generated, tiles: dict[int, dict[object, Tensor]], traced: bool
    ) -> Tensor:
        """Generated `p`'s selection from its stack's evaluated `tiles`; `traced` by
        `torch.compile`, computed into a buffer of its own (`realised`: eagerly the weight
        itself, so not called)."""
        weight = self._join(p, lambda k, region: self._lay_out(p, k, region, tiles))
        return realised(weight) if traced else weight

    def _join(self, p: Generated | Free, part: Callable[[int, Region], Tensor]) -> Tensor:
        """`part(k, region)` for each region of `p`'s selection, joined along its dim."""
        regions, dim = self._parts[p.name]
        values = [part(k, region) for k, region in enumerate(regions)]
        return values[0] if len(values) == 1 else torch.cat(values, dim=dim)

    def _cut(self, p: Free, value: Tensor) -> Tensor:
        """A view of free `value` cut to `p`'s regions (even when whole: a tensor-parallel
        rank's gradient hooks on it must not reach the leaf)."""
        return self._join(p, lambda k, region: value[tuple(slice(a, b) for a, b in region)])

    def _split(self, s: int, stack_tiles: Tensor) -> dict[tuple[int, int] | None, Tensor]:
        """Stack `s`'s tiles (key None) and, where `partition` found one, its split parts.

        A split's backward is one concatenation; slicing the stack once per parameter makes a
        zero-filled stack-sized gradient per slice and adds them up. Traced, where the tile
        MLP can cut its output (`torch_ops.parts_from_tile_mlp`), `apply` takes the parts from
        it instead.
        """
        parts: dict[tuple[int, int] | None, Tensor] = {None: stack_tiles}
        spans = self._splits[s]
        if spans is not None:
            parts.update(split_into(stack_tiles, spans))
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
            with torch.inference_mode(False):  # kept for later calls, which may train
                self._index[key] = [
                    rows if isinstance(rows, slice) else torch.tensor(rows, device=device)
                    for rows in self._rows[name, k]
                ]
        return self._index[key]


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


def _checked(p: Generated | Free | None, name: str, entry: object) -> Region | Concat:
    """A selection entry as tuples of Python ints, checked against `p`'s shape (lists, numpy
    or tensor bounds taken; a Concat's joined regions must agree off its `dim`)."""
    if p is None:
        raise ValueError(f"gb.dist: {name!r} is not a parameter of the plan.")
    if not isinstance(entry, Concat):
        return _check_region(p, name, _region(name, entry))
    dim = as_integer(entry.dim)
    if dim is None or not 0 <= dim < len(p.shape):
        raise ValueError(
            f"gb.dist: {name}'s Concat dim must be in [0, {len(p.shape)}), got {entry.dim!r}."
        )
    parts = tuple(_check_region(p, name, _region(name, r)) for r in entry.regions)
    if (
        not parts
        or len({tuple(b - a for i, (a, b) in enumerate(r) if i != dim) for r in parts}) > 1
    ):
        raise ValueError(
            f"gb.dist: {name}'s Concat regions {parts} cannot be joined along dim {dim}: "
            "their sizes differ on another dim (or there are none)."
        )
    return Concat(parts, dim)


def _region(name: str, region: object) -> Region:
    """`region` as `((start, stop), ...)` of Python ints, else a TypeError naming `name`."""
    spans = tuple(region) if isinstance(region, Sequence) else None
    if spans is not None and all(isinstance(x, Sequence) and len(x) == 2 for x in spans):
        bounds = tuple((as_integer(a), as_integer(b)) for a, b in spans)
        if all(a is not None and b is not None for a, b in bounds):
            return bounds
    raise TypeError(
        f"gb.dist: the region of {name} must be one (start, stop) pair of integers per dim, "
        f"got {region!r:.100}."
    )


def _check_region(p: Generated | Free, name: str, region: Region) -> Region:
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
    return region
