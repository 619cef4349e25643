"""What an unreachable `compression=` tells the user: which parameters are stored whole and
why, and the ratio each option that changes the count would reach.

At high ratios the parameters stored whole decide the whole model's ratio: GPT-2's embedding
tables (39M of its 124M parameters) cap it at 3.15x whatever the g-nets, so the advice has
to name them and `embeddings=True`, not only options that shrink the g-nets.
"""

import math
from collections.abc import Callable

from ._entries import Entry, free_reason

# `reach(options, flags)`: the ratios a search spans under them, and whether it reaches the
# target within 10% (the search's own test).
Reach = Callable[[list[dict[str, object]], dict[str, bool]], tuple[float, float, bool]]

_FLAG_LABELS = {"embeddings": "embedding tables", "biases": "biases"}


def advice(
    entries: list[Entry],
    options: list[dict[str, object]],
    flags: dict[str, bool],
    target: float,
    scope: str,
    reach: Reach,
    stored: int = 0,
) -> str:
    """The sentences an `UnreachableError` ends with (after the ratios the search found);
    `stored`: parameters stored besides the g-nets and the parameters (task embeddings)."""
    text = ""
    variants: list[tuple[str, list[dict[str, object]], dict[str, bool]]] = []
    if scope == "model":
        whole, generating = _stored_whole(entries, options, flags)
        if whole:
            kept = sum(whole.values())
            total = sum(math.prod(e.shape) for e in entries)
            tasks = f" and the {stored:,} of the task embeddings" if stored else ""
            text += (
                f" The whole model's ratio counts the {kept:,} parameters stored whole (free "
                f"and frozen){tasks}, which cap it at {total / (kept + stored):.2f}x whatever "
                "the g-nets: " + "; ".join(f"{label}: {n:,}" for label, n in whole.items()) + "."
            )
        variants = [(f"{flag}=True", options, {**flags, flag: True}) for flag in generating]
        if len(generating) > 1:
            both = {**flags, **dict.fromkeys(generating, True)}
            variants.append((", ".join(f"{f}=True" for f in generating), options, both))
    if not all(o["share"] for o in options):
        shared = [{**o, "share": True} for o in options]
        if variants:  # share=True also with everything generated that could be
            label, _, all_flags = variants[-1]
            variants.append((f"{label}, share=True", shared, all_flags))
        variants.append(("share=True", shared, flags))
    said = []
    for label, opts, fl in variants:
        try:
            lo, hi, reached = reach(opts, fl)
        except ValueError as refused:  # e.g. outputs= wider than a table it would generate
            said.append(f"{label} is refused ({str(refused).removeprefix('gb.plan: ')})")
            continue
        if lo > hi:  # no tile measured: each left every weight (or conditioned one) free
            said.append(
                f"{label} leaves the parameters that read the condition free under every tile"
                if stored
                else f"{label} generates no weight under any tile"
            )
            continue
        said.append(
            f"{label} gives {lo:.2f}x to {hi:.2f}x"
            + (f", which reaches compression={target:g}" if reached else "")
        )
    if said:
        text += " Searched again: " + "; ".join(said) + "."
    if scope == "model":
        text += " compression_of='generated' counts the generated weights only."
    return text


def _stored_whole(
    entries: list[Entry], options: list[dict[str, object]], flags: dict[str, bool]
) -> tuple[dict[str, int], list[str]]:
    """Parameters stored whole whatever the tile, per reason (largest first), and the flags
    (`embeddings`, `biases`) that would generate some of them."""
    counts: dict[str, int] = {}
    by_flag: dict[str, int] = {}
    for entry, opts in zip(entries, options, strict=True):
        reason = free_reason(entry, opts, flags)
        if reason is None:
            continue
        size = math.prod(entry.shape)
        for flag, label in _FLAG_LABELS.items():
            if not flags[flag] and free_reason(entry, opts, {**flags, flag: True}) is None:
                reason = f"{label} ({flag}=False)"
                by_flag[flag] = by_flag.get(flag, 0) + size
        counts[reason] = counts.get(reason, 0) + size
    largest = sorted(((r, n) for r, n in counts.items() if n), key=lambda item: -item[1])
    generating = sorted((f for f, n in by_flag.items() if n), key=lambda f: -by_flag[f])
    return dict(largest), generating
