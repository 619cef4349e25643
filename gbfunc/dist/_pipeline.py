"""Pipeline stages: each stage generates only its own layers' weights, once per step.

Generation runs in two phases around the pipeline schedule (`torch.distributed.pipelining`):

1. `load`: generate the stage's weights without a graph and copy them into the stage
   module's own parameters.
2. The schedule runs forward and backward over every micro-batch; `.grad` accumulates on
   those parameters, and `scale_grads=True` (the default) divides it by the number of
   micro-batches, because they are the module's parameters (generated tensors held outside
   the module would escape that scaling).
3. `backward`: regenerate with a graph and push each parameter's `.grad` into the g-nets.

So the g-net graph is built once per step, not once per micro-batch, and never held across
the schedule.
"""

import torch
from torch import Tensor, nn

from .._plan import Plan, check_is_plan
from .._select import Selection
from .._tiling import full_region
from .._tree import GParams


class StageGenerator:
    """Fill a pipeline stage's parameters from the g-nets, and train the g-nets from its grads.

    Args:
        plan: Plan of the whole model.
        stage: This stage's module, with real (not meta) parameters named as in the whole
            model (a subset of them, e.g. `blocks.2.mlp.fc1.weight`).

    Examples:
        On each pipeline rank, under `torchrun`:

        >>> gen = StageGenerator(plan, stage_module)  # doctest: +SKIP
        >>> gen.load(gparams)  # doctest: +SKIP
        >>> schedule.step(...)  # doctest: +SKIP
        >>> gen.backward(gparams)  # doctest: +SKIP
        >>> sync.wait()  # doctest: +SKIP
    """

    def __init__(self, plan: Plan, stage: nn.Module) -> None:
        check_is_plan(plan, "gb.dist.StageGenerator")
        self.params = dict(stage.named_parameters())
        known = {p.name: p for p in plan.params}
        for name, param in self.params.items():
            if name not in known:
                raise ValueError(
                    f"gb.dist.StageGenerator: stage parameter {name!r} is not in the plan; name "
                    "stage parameters as in the whole model."
                )
            if tuple(param.shape) != known[name].shape or param.is_meta:
                raise ValueError(
                    f"gb.dist.StageGenerator: stage parameter {name!r} is {tuple(param.shape)} on "
                    f"{param.device}; expected a real tensor of shape {known[name].shape}."
                )
        self.selection = Selection(plan, {n: full_region(p.shape) for n, p in self.params.items()})
        self._given: dict[str, Tensor | int | None] = {"condition": None, "task": None}

    def load(
        self,
        gparams: GParams,
        *,
        condition: Tensor | None = None,
        task: int | Tensor | None = None,
    ) -> None:
        """Phase 1: write this stage's weights into its module (no graph); clear its grads.
        A conditioned plan takes `condition` or `task` as `gb.apply` does; `backward` uses
        the same."""
        self._given = {"condition": condition, "task": task}
        with torch.no_grad():
            weights = self.selection.apply(
                gparams, **self._given, where="gb.dist.StageGenerator.load"
            )
            for name, value in weights.items():
                self.params[name].copy_(value)
        for param in self.params.values():
            param.grad = None

    def backward(self, gparams: GParams) -> None:
        """Phase 3: regenerate with a graph (for `load`'s condition or task) and backpropagate
        the stage's `.grad` into `gparams` (and into the condition, where it needs one)."""
        weights = self.selection.apply(
            gparams, **self._given, where="gb.dist.StageGenerator.backward"
        )
        pairs = [
            (weights[name], param.grad)
            for name, param in self.params.items()
            if param.grad is not None and weights[name].requires_grad
        ]
        if pairs:
            torch.autograd.backward([w for w, _ in pairs], [g for _, g in pairs])
