"""The CPU loops' mode in force for this process, and whether a build has failed since.

Every eager `gb.apply` reads it (`loops_state`, part of the route memo's key), so it is a
leaf: it imports nothing of gbfunc, builds nothing and reads only the environment.
`$GBFUNC_CPU_LOOPS` is read on each call, so a changed variable takes effect at once.
"""

import os

MODES = ("off", "portable", "auto")
MODE_VARIABLE = "GBFUNC_CPU_LOOPS"

_forced: str | None = None  # set_mode's; None: the environment's
_failure: str | None = None  # why the loops are off for this process, once a build failed
_generation = 0  # set_mode's calls


def mode() -> str:
    """The loops' mode in force: `set_mode`'s, else `$GBFUNC_CPU_LOOPS`, else `auto`."""
    if _forced is not None:
        return _forced
    value = os.environ.get(MODE_VARIABLE, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"gbfunc: {MODE_VARIABLE}={value!r}; expected one of {MODES}.")
    return value


def set_mode(value: str | None) -> None:
    """Force the loops' mode for this process (`None`: back to `$GBFUNC_CPU_LOOPS`), which
    also forgets an earlier failure. Code that `torch.compile` traced earlier keeps the choice
    it baked in (`torch._dynamo.reset()`)."""
    global _forced, _failure, _generation
    if value is not None and value not in MODES:
        raise ValueError(f"gbfunc.cpu.set_mode: mode must be one of {MODES}, got {value!r}.")
    _forced = value
    _failure = None
    _generation += 1  # decisions remembered before (a compiler missing then) are not reused


def failure() -> str | None:
    """Why the loops are off for this process after a failed build or load, or None."""
    return _failure


def record_failure(reason: str) -> str:
    """Turn the loops off for this process because of `reason`; returns the message kept."""
    global _failure
    message = f"building or loading them failed: {reason}"
    _failure = message if len(message) <= 2000 else message[:2000] + " ..."
    return _failure


def loops_state() -> tuple:
    """What decides whether loops run, as a key for remembered decisions: the mode, the
    compiler asked for, whether a build has failed, and `set_mode`'s calls."""
    return (mode(), os.environ.get("CXX"), _failure is None, _generation)
