"""FSDP2 for the free parameters of a p-net whose other weights come from replicated g-nets.

Embeddings and norms are what a genomic-bottleneck model stores at full size, so they are
what sharding saves: `fully_shard` (FSDP2) shards them over the data-parallel ranks and
all-gathers them around each forward and backward, while every rank generates the weights
from its own copy of the g-nets, whose gradients `GradSync` all-reduces.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from .._check_gparams import TASKS
from .._check_model import check_matches
from .._plan import Plan
from .._select import Selection
from .._tiling import full_region
from .._tree import GParams, stack_leaves


class ShardedFree:
    """Shard `model`'s free parameters with FSDP2; generate its other weights from g-nets.

    Args:
        plan: The model's plan.
        model: The p-net, its free parameters real tensors holding their values (e.g. the
            model the plan was made from). Its generated weights are never read: they are
            replaced by `meta` tensors, releasing their memory.
        mesh: The data-parallel mesh (1-D), e.g. `mesh["dp"]`.
        modules: Submodules to shard first, each its own FSDP group that is all-gathered
            only around its own forward and backward (e.g. transformer blocks); the rest of
            the free parameters form the root's group.
        **fsdp: More arguments for `fully_shard` (`reshard_after_forward`, `mp_policy`...).

    Attributes:
        free: The free parameters, now sharded (DTensors): train them with the g-nets, e.g.
            `AdamW([*gnet_leaves, *sharded.free])`; FSDP2 averages their gradients over the
            ranks, `GradSync` of the g-net leaves does the same for the g-nets. Checkpoint
            them, the g-nets and the optimizer with
            `gb.dist.save_sharded(path, sharded.state(gparams), plan=plan, optimizer=opt)`.

    Examples:
        On every rank, under `torchrun`:

        >>> sharded = ShardedFree(plan, model, mesh["dp"])  # doctest: +SKIP
        >>> out = functional_call(model, sharded.apply(gparams), (x,))  # doctest: +SKIP
    """

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        mesh: DeviceMesh,
        modules: Sequence[nn.Module] = (),
        **fsdp: object,
    ) -> None:
        check_matches(plan, model, "gb.dist.ShardedFree", "the plan")
        generated = {_release(model, p.name) for p in plan.generated}
        for module in [*modules, model]:
            fully_shard(module, mesh=mesh, ignored_params=generated, **fsdp)
        self.plan = plan
        self.selection = Selection(plan, {p.name: full_region(p.shape) for p in plan.generated})
        self.free = [model.get_parameter(p.name) for p in plan.free if p.trainable]
        self._frozen = {p.name: model.get_parameter(p.name) for p in plan.free if not p.trainable}

    def apply(
        self,
        gparams: GParams,
        *,
        condition: Tensor | None = None,
        task: int | Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The generated weights only, for `functional_call(model, ...)`: the free parameters
        are the model's own, which FSDP2 all-gathers around its forward. A conditioned plan
        takes `condition` or `task` as `gb.apply` does."""
        return self.selection.apply(
            gparams, condition=condition, task=task, where="gb.dist.ShardedFree.apply"
        )

    def state(self, gparams: GParams) -> GParams:
        """`gparams` with the model's sharded free and frozen parameters as its own: what
        `gb.dist.save_sharded` writes and `load_sharded(into=...)` fills, each rank its shard.
        """
        names = [p.name for p in self.plan.free if p.trainable]
        return {
            **gparams,
            "free": dict(zip(names, self.free, strict=True)),
            "frozen": dict(self._frozen),
        }

    @staticmethod
    def gnet_leaves(gparams: GParams) -> list[Tensor]:
        """The g-net stacks' leaves and any task embeddings: what `GradSync` all-reduces
        (`gparams["free"]` is unused)."""
        tasks = [gparams[TASKS]] if TASKS in gparams else []
        return stack_leaves(gparams["stacks"]) + tasks


def _release(model: nn.Module, name: str) -> nn.Parameter:
    """Replace parameter `name` of `model` by a `meta` one of its shape, under every name it
    has (a tied weight, e.g. a head sharing the embedding's, stays tied: left real, FSDP2
    would shard it as a free parameter and `functional_call` would use it); return it."""
    old = model.get_parameter(name)
    new = nn.Parameter(torch.empty_like(old, device="meta"), requires_grad=old.requires_grad)
    for module in model.modules():
        for leaf, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if param is old:
                module.register_parameter(leaf, new)
    return new
