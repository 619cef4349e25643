"""What `gb.Bottleneck` checks of what it is given, apart from the plan and gparams (the
package's own checks): its plan options, a state dict it loads, and a p-net changed under
it (gradient checkpointing inside the p-net)."""

import difflib
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ._planner import plan as make_plan

# `nn.Module`'s `state_dict` key for `get_extra_state`.
EXTRA_STATE = "_extra_state"

# Activation checkpointing inside the p-net recomputes its layers in the backward pass, after
# `functional_call` has put the p-net's own (unused, stale) weights back: wrong gradients.
CHECKPOINTING = (
    "gb.Bottleneck: gradient checkpointing inside the p-net would recompute its layers in the "
    "backward pass with the p-net's own dense weights, not the generated ones (wrong "
    "gradients); checkpoint the whole call instead: torch.utils.checkpoint.checkpoint(b, x, "
    "use_reentrant=False), or turn it off (model.activation_checkpointing_disable())."
)


def check_same_stacks(module: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    """Refuse, whatever `strict` says and before anything loads, a state whose g-net stacks
    are not this module's: made with another plan, it would load in part (transformers'
    `Trainer` loads with `strict=False`) and train on from fresh g-nets without a word, or
    load whole and generate other weights. A state saved before the plan's fingerprint was
    in it (no `_extra_state`) is checked by its stacks' shapes alone."""
    theirs = {
        k.removeprefix(prefix): tuple(v.shape)
        for k, v in state_dict.items()
        if k.startswith(prefix + "stacks.")
    }
    mine = {f"stacks.{k}": tuple(v.shape) for k, v in module.stacks.state_dict().items()}
    if theirs and theirs != mine:
        differing = sorted(set(theirs) ^ set(mine)) or [
            k for k in sorted(mine) if theirs[k] != mine[k]
        ]
        raise ValueError(
            f"gb.Bottleneck.load_state_dict: the state's g-net stacks are not this module's "
            f"(first difference: {differing[0]!r}); it was saved from another plan. Build the "
            "module with the saved run's plan: gb.Bottleneck(model, plan)."
        )
    stored = state_dict.get(prefix + EXTRA_STATE)
    if stored is None:
        state_dict[prefix + EXTRA_STATE] = module.get_extra_state()  # so strict passes
    elif not (isinstance(stored, Tensor) and torch.equal(stored.cpu(), module.get_extra_state())):
        raise ValueError(
            "gb.Bottleneck.load_state_dict: the state was saved from another plan: its "
            f"fingerprint ({prefix + EXTRA_STATE!r}) is not this module's plan's, so its "
            "g-nets would generate other weights here, even where their shapes agree "
            "(another activation, center, scale, or the model's dtype when the module was "
            "built). Build the module with the saved run's plan: gb.Bottleneck(model, plan)."
        )


def check_plan_options(options: dict[str, Any]) -> None:
    """Raise `TypeError` for an option `gb.plan` does not take, naming the nearest one."""
    known = [n for n in inspect.signature(make_plan).parameters if n != "model"]
    for name in options:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise TypeError(
                f"gb.Bottleneck: unknown option {name!r}; {hint}gb.plan's options are "
                f"{', '.join(known)}."
            )


def check_pnet_unchanged(pnet: nn.Module) -> None:
    """Raise `CHECKPOINTING` where a layer of the p-net was wrapped by torch's
    `checkpoint_wrapper` after the module was built (its parameters are then renamed, and
    `functional_call` failed with a bare `KeyError`)."""
    if any(type(m).__name__ == "CheckpointWrapper" for m in pnet.modules()):
        raise ValueError(CHECKPOINTING)
