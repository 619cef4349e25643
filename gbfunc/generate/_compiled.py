"""Functions compiled once per key, for eager callers, with a fallback where compiling fails."""

import types
import warnings
from collections.abc import Callable, Hashable

import torch

from .._tracing import dynamo_disabled


class CompiledCache:
    """`torch.compile(fullgraph=True, dynamic=False)` of a function per key, cached.

    Each key compiles its own copy of the function's code: dynamo keeps compiled graphs on the
    code object and caps their number, so sharing one would recompile (and fall back to eager)
    once there are more keys than that cap. A key whose compile fails (e.g. no C++ compiler
    for inductor), or whose code dynamo recompiles past its limit (what the key leaves out
    changed too often: strides, devices), warns once, naming `what`, and is remembered:
    `call` returns None for it.
    It also returns None, silently, while dynamo is switched off
    (`torch._dynamo.config.disable`, a debugging setting), where `torch.compile(fullgraph=True)`
    would raise "found no compiled frames".

    Each call checks only the guards on its tensors and on torch's global state (grad mode,
    default device...), not the hundreds on what the key fixes (a plan's tiles and layout) or
    on gbfunc's and torch's module globals: checking those on every call would cost a
    noticeable part of a small model's eager step. So the key must name every non-tensor
    argument that the compiled code depends on.

    Inductor's C++ code is compiled with floating-point contraction (`a * b + c` as one fused
    multiply-add, rounded once), which its global default leaves off: the tile MLP's sums of
    products, such as the one-output forward, run faster fused. Only these compiles get it;
    the process's inductor settings are not touched.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._compiled: dict[Hashable, Callable | None] = {}

    def call(self, key: Hashable, fn: Callable, *args: object) -> object | None:
        """`fn(*args)` through the code compiled for `key`, or None where that compile failed
        or dynamo is switched off: the caller runs `fn` op by op."""
        if dynamo_disabled():
            return None
        if key not in self._compiled:
            private = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            self._compiled[key] = torch.compile(
                private,
                fullgraph=True,
                dynamic=False,
                options=_options(),
            )
        compiled = self._compiled[key]
        if compiled is None:
            return None
        try:
            return compiled(*args)
        except (
            torch._dynamo.exc.BackendCompilerFailed,
            torch._dynamo.exc.FailOnRecompileLimitHit,  # fullgraph=True raises, not falls back
        ) as error:
            self.forget(key, f"compiling {self.what} failed ({type(error).__name__}: {error})")
            return None

    def forget(self, key: Hashable, why: str) -> None:
        """Warn, saying `why`, that `key`'s compiled code is not used, and remember it:
        `call` returns None for the key from now on."""
        self._compiled[key] = None
        warnings.warn(
            f"gbfunc: {why}; it runs op by op. gb.apply(..., compile=False) skips compiling.",
            RuntimeWarning,
            stacklevel=4,
        )


def _options() -> dict[str, object]:
    """`torch.compile` options for the cache's compiles, those this torch knows."""
    from torch._inductor import config as inductor_config

    options: dict[str, object] = {}
    if hasattr(torch.compiler, "keep_tensor_guards_unsafe"):  # came with guard_filter_fn
        options["guard_filter_fn"] = _tensor_and_global_state_guards
    if _FP_CONTRACT in inductor_config.get_config_copy():
        options[_FP_CONTRACT] = "fast"
    return options


_FP_CONTRACT = "cpp.enable_floating_point_contract_flag"

# Guards on tensors themselves: their metadata, and which of them are the same tensor
# (dynamo derives its no-aliasing check from the TENSOR_MATCH guards it keeps).
_TENSOR_GUARDS = frozenset({"TENSOR_MATCH", "DUPLICATE_INPUT"})


def _tensor_and_global_state_guards(entries: list) -> list[bool]:
    """Dynamo's `guard_filter_fn`: keep global state guards (they have no source name) and
    tensor guards on the arguments; drop the rest, including any on module globals (`G[...]`)."""
    return [
        not e.name or (e.guard_type in _TENSOR_GUARDS and not e.name.startswith("G["))
        for e in entries
    ]
