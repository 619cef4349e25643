"""What the paths' rules read: a call of `gb.apply` and its context, and the policy of
gbfunc's own compiles that several paths share (when compiling is asked for, when a stack
compiles, when nothing compiled can run).

Below both the dispatcher, which makes the call records, and the paths, which judge them.
"""

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from .._plan import Plan, Stack
from ..cpu import missing_compiler

# `compile=None` compiles a plan's graph from this many generated weights on: the MLP
# 784-512-512-10 (669k) pays back its compile (~10-15 s on 2 cores) in a few thousand steps;
# models of a few thousand weights (tests, examples) stay uncompiled.
AUTO_GRAPH_WEIGHTS = 1 << 18
# `compile=None` compiles a stack's tile MLP in eager mode from this many elements of its
# transient `(T, TH, Q, H)` on (about 1M): such a stack costs milliseconds per step eagerly,
# and its compile (a few seconds) pays back within a few thousand steps.
AUTO_COMPILE_ELEMENTS = 1 << 20
# Why a path whose ops carry autograd rules of their own (the C loops', the kernels') is not
# taken where `Context.plain` holds.
PLAIN_ONLY = (
    "traced under grad of grad, forward mode or grad inside vmap, where only plain torch ops "
    "are differentiated correctly"
)


class Context(NamedTuple):
    """What a call of `gb.apply` decides its paths from, read once per call by the
    dispatcher (`gbfunc._dispatch.context_of`)."""

    device: str  # the g-nets' device type
    dtype: torch.dtype  # their dtype
    backend: str  # gb.apply's `backend=`
    compile: bool | None  # gb.apply's `compile=`
    compiling: bool  # traced by torch.compile
    exporting: bool  # traced by torch.export
    transformed: bool  # inside a torch.func transform (grad, vmap...)
    grad: bool  # gradients enabled
    dynamo_off: bool  # torch._dynamo.config.disable: nothing compiles
    dispatch_mode: bool  # inside a TorchDispatchMode (FlopCounterMode...): compiled code cannot run
    forward_ad: bool = False  # a forward-mode dual level is open (torch.autograd.forward_ad)
    nested: bool = False  # inside two or more torch.func transforms (`grad` of `vmap`...)
    # traced under transforms that dynamo traces no custom autograd.Function under
    # (`_tracing.functions_traceable`): plain autograd only
    plain: bool = False

    @property
    def eager(self) -> bool:
        """Neither traced nor transformed: where gbfunc may run compiled code of its own."""
        return not self.compiling and not self.transformed


class Call(NamedTuple):
    """One stack's decision: in `plan` (None: a selection of it), with the g-nets `stacks`;
    `placed`: its parameters are selected whole; `detail`: reasons say exactly why (for
    `gb.explain`; the hot path and traced code take fixed strings)."""

    plan: Plan | None
    stack: Stack
    stacks: Mapping[str, Mapping[str, Tensor]]
    context: Context
    placed: bool
    detail: bool = False
    index: int = -1  # the stack's index in `plan`

    @property
    def leaves(self) -> Mapping[str, Tensor]:
        return self.stacks[self.stack.key]


def compiling_asked(plan: Plan, context: Context) -> bool:
    """Whether an eager call compiles (or takes the loops) for `plan`: `compile=True`; with
    `None`, plans of `AUTO_GRAPH_WEIGHTS` weights, and with gradients on also plans with a
    stack of `AUTO_COMPILE_ELEMENTS` hidden activations (evaluation generates once per use,
    where a compile does not pay, but the loops, built once per machine, do)."""
    if context.compile is not None:
        return context.compile
    large = sum(p.numel for p in plan.generated) >= AUTO_GRAPH_WEIGHTS
    if not context.grad:
        return large
    return large or any(compiles_eagerly(s, None) for s in plan.stacks)


def compiles_eagerly(stack: Stack, compile: bool | None) -> bool:
    """Whether an eager call runs this stack's tile MLP compiled (`compile=None`: stacks of
    `AUTO_COMPILE_ELEMENTS` hidden activations)."""
    if compile is not None:
        return compile
    return stack.hidden_elements >= AUTO_COMPILE_ELEMENTS


def own_compile_refused(context: Context) -> str | None:
    """Why gbfunc cannot run compiled code of its own for this call (None: it can)."""
    if not context.eager:
        return "traced or transformed: the caller's graph holds it"
    if context.dynamo_off:
        return "dynamo is switched off (torch._dynamo.config.disable)"
    if context.dispatch_mode:
        return "a TorchDispatchMode is active: compiled code cannot run inside it"
    if context.forward_ad:
        return "forward-mode AD is active: compiled code has no forward-mode rule"
    return None


def compiler_missing(call: Call) -> str | None:
    """Why nothing compiled runs on CPU (no C++ compiler), warned once where eager code would
    have compiled (traced code: the caller's compile fails first)."""
    return missing_compiler(warn=call.context.eager and not call.detail)
