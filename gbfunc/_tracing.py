"""What torch is doing to the call: whether `torch.export` traces it (the one reading of it
for every torch version), whether dynamo is switched off, whether transforms nest, whether
dynamo traces a custom `autograd.Function` under them, whether gradients are legacy batched
tensors, and autocast (which generation turns off).

`torch.compiler.is_exporting()` returns the flag `torch.export` sets while it traces. Dynamo up
to torch 2.11 at least (2.13 reads the flag) folds the call to `True` in every graph it traces,
so under `torch.compile` each call looked like an export: no CPU loops or units-major C form in
compiled graphs, and no generated parameter computed into a buffer of its own (`_realised`).
Read directly, the flag is right under both (checked on 2.11 and 2.13: `False` in eager and in
`torch.compile`, `True` in `torch.export.export`, strict and not).
"""

import contextlib
import functools
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
from torch import Tensor

_Key = TypeVar("_Key", bound=Hashable)
_Value = TypeVar("_Value")


def exporting() -> bool:
    """Traced by `torch.export` (strict or not), not by `torch.compile`, and not eager."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def dynamo_disabled() -> bool:
    """Whether dynamo is switched off (`torch._dynamo.config.disable`, a debugging setting)."""
    return bool(torch._dynamo.config.disable)


@torch.compiler.assume_constant_result
def transforms() -> int:
    """How many `torch.func` transforms wrap the call (`grad` of `vmap`, `jacrev`: 2). Run
    in Python where `torch.compile` traces it: dynamo cannot trace the interpreter stack,
    and folds `peek_interpreter_stack()` to not-None in every graph."""
    stack = torch._C._functorch.get_interpreter_stack()
    return 0 if stack is None else len(stack)


@torch.compiler.assume_constant_result
def functions_traceable() -> bool:
    """Whether dynamo traces a custom `autograd.Function` correctly under the `torch.func`
    transforms that wrap the call (torch 2.13): under none, one `grad`/`vjp` level, `vmap`s,
    or `vmap`s inside one `grad`. Not under two reverse-mode levels (`grad` of `grad`, MAML's
    inner step: the Function's backward, differentiated again, came out wrong without a
    word), a forward-mode level (`jvp`, `jacfwd`, `hessian`: no forward rule is traced), or a
    `grad` inside a `vmap` ("You tried to vmap over ApplyTemplate"). Run in Python where
    `torch.compile` traces it, as `transforms`."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    kinds = [level.key() for level in stack]  # outermost first
    kind = torch._C._functorch.TransformType
    if kind.Jvp in kinds or kinds.count(kind.Grad) > 1:
        return False
    return kind.Grad not in kinds or kind.Vmap not in kinds[: kinds.index(kind.Grad)]


def eager_memo(build: Callable[[_Key], _Value]) -> Callable[[_Key], _Value]:
    """`build`, remembered per argument for eager calls (the last 64), called afresh where
    torch.compile traces: dynamo would guard on the cache, and its graph keeps the result."""
    remembered = functools.lru_cache(maxsize=64)(build)

    @functools.wraps(build)
    def memo(key: _Key) -> _Value:
        return build(key) if torch.compiler.is_compiling() else remembered(key)

    return memo


def plain_eager() -> bool:
    """Neither traced by `torch.compile` nor inside a `torch.func` transform.

    Dynamo refuses to run compiled code under a functorch transform ("Unsupported functorch
    tracing attempt"), so compiled bodies are only used outside both.
    """
    return (
        not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None
    )


def legacy_batched(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether eager gradients are autograd's legacy batched tensors, which have no storage
    (never so in traced code, where dynamo cannot ask)."""
    if torch.compiler.is_compiling():
        return False
    return not all(g is None or torch._C._has_storage(g) for g in grads)


def autocast_off(leaf: Tensor | None) -> contextlib.AbstractContextManager:
    """Autocast off on the g-nets' device (that of `leaf`, a g-net leaf) where it is on:
    weights are computed in the g-nets' dtype, as the loops and kernels do, whatever autocast
    the caller runs under (the torch path's matmuls ran in bfloat16 under CPU autocast, and
    handed the loops bfloat16 tensors they read as float32)."""
    device = None if leaf is None else leaf.device.type
    if device is None or not torch.amp.is_autocast_available(device):
        return contextlib.nullcontext()
    if torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()
