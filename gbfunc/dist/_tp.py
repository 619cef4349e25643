"""Tensor-parallel p-nets: each rank generates only the tiles of its own shard of each weight.

The model is sharded with `torch.distributed.tensor.parallel.parallelize_module` (column-
then row-parallel MLPs, head-parallel attention); its DTensor parameters say which shard of
each weight a rank holds. The rank generates that shard and wraps it with
`DTensor.from_local`: no weight is ever communicated.

Gradients: a shard's g-net gradients are partial sums over disjoint weights, so they are
*summed* over the tensor-parallel group (`GradSync` sums over every rank). A parameter
replicated over the group gets the same gradient on every rank; its gradient is scaled by
`1 / tp` on the way into the g-nets, so that the sum is the average.
"""

import fnmatch
import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from .._check_model import check_matches
from .._numbers import integer
from .._plan import Generated, Plan
from .._select import Selection
from .._tiling import Concat, Region, cuts_tiles, full_region
from .._tree import GParams


def local_region(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: DeviceMesh, name: str
) -> Region:
    """The region of a parameter of global `shape` that this rank holds (DTensor's chunking)."""
    spans = [list(span) for span in full_region(shape)]
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            start, stop = spans[placement.dim]
            size = stop - start
            chunk = -(-size // mesh.size(dim))
            if (mesh.size(dim) - 1) * chunk >= size:  # the same on every rank: all raise
                raise ValueError(
                    f"gb.dist.TensorParallel: {name} has {size} along dim {placement.dim}, "
                    f"which DTensor cuts into chunks of {chunk} for {mesh.size(dim)} ranks: "
                    "the last rank would hold none of it. Leave it out of the tensor-parallel "
                    "plan (replicated), or use fewer tensor-parallel ranks."
                )
            lo = min(start + coordinate[dim] * chunk, stop)
            spans[placement.dim] = [lo, min(lo + chunk, stop)]
        elif not placement.is_replicate():
            raise ValueError(
                f"gb.dist.TensorParallel: {name} has placement {placement}; "
                "expected Shard or Replicate."
            )
    return tuple(map(tuple, spans))


def fused_regions(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: DeviceMesh, parts: int
) -> Concat:
    """This rank's slice of each of the `parts` equal matrices that a parameter holds side by
    side along its sharded dim, joined: the local shard when the DTensor's global order is
    the parts interleaved per rank (`[Q0 K0 V0 | Q1 K1 V1]` for GPT-2's `c_attn`)."""
    dims = [pl.dim for pl in placements if isinstance(pl, Shard)]
    if len(dims) != 1 or shape[dims[0]] % parts:
        raise ValueError(
            f"gb.dist.TensorParallel: a fused parameter of shape {shape} needs one Shard "
            f"placement on a dim divisible by its {parts} parts, got {placements}."
        )
    dim = dims[0]
    size = shape[dim] // parts
    local = local_region((*shape[:dim], size, *shape[dim + 1 :]), placements, mesh, "fused")
    (lo, hi) = local[dim]
    regions = []
    for j in range(parts):
        spans = list(local)
        spans[dim] = (j * size + lo, j * size + hi)
        regions.append(tuple(spans))
    return Concat(tuple(regions), dim)


def _checked_fused(fused: object, plan: Plan) -> dict[str, int]:
    """`fused` as `{pattern: parts}`, each pattern matching a parameter of the plan and each
    count an integer >= 1 (a pattern that matches nothing would leave a fused parameter
    sharded as one matrix, its shards holding the wrong weights)."""
    where = "gb.dist.TensorParallel"
    if fused is None:
        return {}
    if not isinstance(fused, Mapping):
        raise TypeError(
            f"{where}: fused must be a dict {{name_pattern: parts}}, got {fused!r:.100}."
        )
    checked = {}
    for pattern, parts in fused.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{where}: fused's keys must be name patterns, got {pattern!r:.100}.")
        checked[pattern] = integer(where, f"fused[{pattern!r}]", parts, minimum=1)
        if not any(fnmatch.fnmatch(p.name, pattern) for p in plan.params):
            raise ValueError(
                f"{where}: fused pattern {pattern!r} matches no parameter of the plan."
            )
    return checked


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


class TensorParallel:
    """This rank's shards of every parameter, generated from replicated g-nets.

    Args:
        plan: The plan of the unsharded model (`gb.plan` before or after parallelizing: the
            names and global shapes are the same).
        model: The model after `parallelize_module` on `mesh` (the `meta` device is fine: its
            own weights are never used).
        mesh: The tensor-parallel mesh, e.g. `mesh["tp"]`.
        fused: `{name_pattern: parts}` (fnmatch) for parameters that hold `parts` equal
            matrices side by side along their sharded dim and are sharded part by part, each
            rank its slice of every part: GPT-2's `c_attn` (Q, K, V: `3`), sharded by heads.
            The model's DTensor order is then the parts interleaved per rank.

    Attributes:
        misaligned: Parameters whose shard edges cut through tiles; those tiles are generated
            on both neighbouring ranks. Choose tiles that divide `dim / tp` to avoid it.

    Examples:
        On every tensor-parallel rank, under `torchrun`:

        >>> parallelize_module(model, mesh["tp"], gpt.tp_plan(model))  # doctest: +SKIP
        >>> tp = TensorParallel(plan, model, mesh["tp"])  # doctest: +SKIP
        >>> out = functional_call(model, tp.apply(gparams), (x,))  # doctest: +SKIP
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        mesh: DeviceMesh,
        fused: Mapping[str, int] | None = None,
    ) -> None:
        check_matches(plan, model, "gb.dist.TensorParallel", "the plan")
        fused = _checked_fused(fused, plan)
        names = dict(model.named_parameters())
        regions: dict[str, Region | Concat] = {}
        self._wrap: dict[str, tuple[tuple[Placement, ...] | None, float, tuple[int, ...]]] = {}
        self.misaligned: tuple[str, ...] = ()
        for p in plan.params:
            param = names[p.name]
            if isinstance(param, DTensor):
                if param.device_mesh != mesh:
                    raise ValueError(
                        f"gb.dist.TensorParallel: {p.name} is sharded on {param.device_mesh}, "
                        f"not on the given mesh {mesh}."
                    )
                placements = tuple(param.placements)
                parts = next((n for pat, n in fused.items() if fnmatch.fnmatch(p.name, pat)), 1)
                if parts > 1:
                    regions[p.name] = fused_regions(p.shape, placements, mesh, parts)
                else:
                    regions[p.name] = local_region(p.shape, placements, mesh, p.name)
                copies = math.prod(
                    mesh.size(d) for d, pl in enumerate(placements) if not isinstance(pl, Shard)
                )
            else:
                placements = None
                regions[p.name] = full_region(p.shape)
                copies = mesh.size()
            self._wrap[p.name] = (placements, 1.0 / copies, p.shape)
            region = regions[p.name]
            parts = region.regions if isinstance(region, Concat) else (region,)
            stack = plan.stacks[p.stack_index] if isinstance(p, Generated) else None
            if stack is not None and any(cuts_tiles(p, stack, r) for r in parts):
                self.misaligned += (p.name,)
        self.mesh = mesh
        self.selection = Selection(plan, regions)

    def apply(
        self,
        gparams: GParams,
        *,
        condition: Tensor | None = None,
        task: int | Tensor | None = None,
    ) -> dict[str, Tensor]:
        """`{name: DTensor shard or replicated tensor}` for `functional_call` on the model;
        a conditioned plan takes `condition` or `task` as `gb.apply` does."""
        out: dict[str, Tensor] = {}
        weights = self.selection.apply(
            gparams, condition=condition, task=task, where="gb.dist.TensorParallel.apply"
        )
        for name, local in weights.items():
            placements, scale, shape = self._wrap[name]
            if scale != 1.0 and local.requires_grad:  # identical copies: their sum is the mean
                local.register_hook(lambda grad, scale=scale: grad * scale)
            if placements is None:
                out[name] = local
                continue
            out[name] = DTensor.from_local(
                local,
                self.mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=_contiguous_stride(shape),
            )
        return out
