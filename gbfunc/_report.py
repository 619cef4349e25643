"""`gb.report`: exact parameter counts of a plan, as data and as a table."""

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from torch import nn

from ._check_model import is_bottleneck
from ._plan import TILE_LEAVES, Free, Generated, Plan, Shaped, Stack


@dataclass(frozen=True)
class Row(Shaped):
    """One parameter of the p-net.

    Attributes:
        name: Parameter name.
        shape: Its shape.
        kind: `"generated"`, `"free"` or `"frozen"`.
        tiles: Tiles that generate it (0 for free parameters).
        gnet_params: G-net parameters spent on it (its tiles' g-nets, plus its share of
            shared g-nets and tile embeddings); for free parameters, its own size.
        ratio: `numel / gnet_params` (1.0 for free parameters).
        note: Stack key, or why the parameter is free.
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    tiles: int
    gnet_params: int
    ratio: float
    note: str


@dataclass(frozen=True)
class Report:
    """Per-parameter rows and totals; `str(report)` is a table.

    Attributes:
        rows: One per p-net parameter.
        task_shape: Shape of the learned task embeddings (`gb.plan(..., tasks=n)`), stored
            and trained beside the g-nets; `()` where the plan has none.

    Examples:
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> report = gb.report(gb.plan(model, tile=(32, 32)))
        >>> [(row.name, row.kind, row.tiles) for row in report.rows]
        [('0.weight', 'generated', 64), ('0.bias', 'free', 0),
         ('2.weight', 'generated', 8), ('2.bias', 'free', 0)]
        >>> report.dense_params, report.stored_params
        (68362, 27730)
        >>> print(f"{report.compression:.1f}x fewer parameters to store")
        2.5x fewer parameters to store
    """

    rows: tuple[Row, ...]
    task_shape: tuple[int, ...] = ()

    @property
    def task_params(self) -> int:
        """Parameters of the task embeddings."""
        return math.prod(self.task_shape) if self.task_shape else 0

    @property
    def dense_params(self) -> int:
        """Parameters of the p-net (tied parameters counted once)."""
        return sum(r.numel for r in self.rows)

    @property
    def generated_weights(self) -> int:
        return self._numel("generated")

    @property
    def gnet_params(self) -> int:
        """Trainable g-net parameters (stacks, tile embeddings)."""
        return sum(r.gnet_params for r in self.rows if r.kind == "generated")

    @property
    def free_params(self) -> int:
        return self._numel("free")

    @property
    def frozen_params(self) -> int:
        return self._numel("frozen")

    @property
    def stored_params(self) -> int:
        """The parameters a compressed checkpoint holds: g-nets, free and frozen parameters,
        task embeddings. Frozen ones are stored but not trained; the model's buffers
        (BatchNorm's statistics), which a checkpoint holds too, are not parameters and are
        not counted."""
        return self.gnet_params + self.free_params + self.frozen_params + self.task_params

    def _numel(self, kind: str) -> int:
        """Elements of the rows of `kind`."""
        return sum(r.numel for r in self.rows if r.kind == kind)

    @property
    def generated_compression(self) -> float:
        """Generated weights per g-net parameter."""
        return self.generated_weights / max(1, self.gnet_params)

    @property
    def compression(self) -> float:
        """Dense parameters per stored parameter (`stored_params`), the whole model."""
        return self.dense_params / max(1, self.stored_params)

    def __str__(self) -> str:
        header = ("parameter", "shape", "kind", "tiles", "stored", "ratio", "note")
        lines = [
            (
                r.name,
                "x".join(map(str, r.shape)) or "scalar",
                r.kind,
                str(r.tiles),
                f"{r.gnet_params:,}",
                f"{r.ratio:.1f}x",
                r.note,
            )
            for r in self.rows
        ]
        if self.task_shape:
            shape = "x".join(map(str, self.task_shape))
            lines.append(
                ("tasks", shape, "tasks", "0", f"{self.task_params:,}", "", "task embeddings")
            )
        lines.append(
            (
                "generated",
                f"{self.generated_weights:,}",
                "",
                "",
                f"{self.gnet_params:,}",
                f"{self.generated_compression:.1f}x",
                "weights / g-net params",
            )
        )
        lines.append(
            (
                "whole model",
                f"{self.dense_params:,}",
                "",
                "",
                f"{self.stored_params:,}",
                f"{self.compression:.1f}x",
                "dense / stored params",
            )
        )
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        fmt = "  ".join(f"{{:{'<' if i in (0, 2, 6) else '>'}{w}}}" for i, w in enumerate(widths))
        rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
        body = [fmt.format(*row) for row in lines]
        return "\n".join([fmt.format(*header), rule, *body[:-2], rule, *body[-2:]])


def report(plan: Plan) -> Report:
    """Exact per-parameter accounting of `plan`.

    Args:
        plan: From `gb.plan(model, ...)`; counted from its shapes alone, so the model need
            not be alive.

    Returns:
        A `gb.Report`: one row per p-net parameter and the totals; `print(report)` shows
            them as a table.

    Examples:
        >>> rep = gb.report(gb.plan(nn.Linear(256, 128), tile=(32, 32)))
        >>> rep.generated_weights, rep.gnet_params
        (32768, 12320)
    """
    if not isinstance(plan, Plan):
        hint = ""
        if is_bottleneck(plan):
            hint = " Pass its .plan, or call its .report()."
        elif isinstance(plan, nn.Module):
            hint = " Pass gb.plan(model) instead."
        raise TypeError(f"gb.report: plan must be a gb.Plan, got {type(plan).__name__}.{hint}")
    rows = []
    charges = [_Charges.of(stack) for stack in plan.stacks]
    for p in plan.params:
        if isinstance(p, Generated):
            stack = plan.stacks[p.stack_index]
            tiles = sum(b.num_tiles for b in p.blocks)
            cost = charges[p.stack_index].cost(stack, p)
            rows.append(Row(p.name, p.shape, "generated", tiles, cost, p.numel / cost, stack.key))
        else:
            assert isinstance(p, Free)
            kind = "free" if p.trainable else "frozen"
            rows.append(Row(p.name, p.shape, kind, 0, p.numel, 1.0, p.reason))
    return Report(tuple(rows), (plan.tasks, plan.condition) if plan.tasks else ())


@dataclass(frozen=True)
class _Charges:
    """What a stack's stored parameters cost per g-net and per tile (its tiles' own leaves:
    embeddings, hashed tables), and each tile's g-net; read once per stack
    (`Stack.gnet_of_tile` builds its tuple on every read)."""

    per_gnet: int
    per_tile: int
    owner: tuple[int, ...]

    @classmethod
    def of(cls, stack: Stack) -> "_Charges":
        shapes = stack.leaf_shapes()
        per_tile = sum(math.prod(shapes[n][1:]) for n in TILE_LEAVES if n in shapes)
        per_gnet = sum(math.prod(s[1:]) for n, s in shapes.items() if n not in TILE_LEAVES)
        return cls(per_gnet, per_tile, stack.gnet_of_tile)

    def cost(self, stack: Stack, p: Generated) -> int:
        """The stored parameters that generate `p`: its tiles' own leaves and the g-nets of
        its tiles, a g-net that also generates other parameters' tiles charged in proportion
        to its tiles here (with `share=True` a g-net generates one parameter, without it one
        tile: either way whole, so the rows add up to the plan's)."""
        tiles = [t for b in p.blocks for t in range(b.first_tile, b.first_tile + b.num_tiles)]
        of_gnet = Counter(self.owner[t] for t in tiles)
        share = sum(Fraction(n, stack.tiles_per_gnet[g]) for g, n in of_gnet.items())
        return round(self.per_gnet * share) + self.per_tile * len(tiles)
