"""`gb.plan`'s options: checked, and resolved per parameter from the overrides that match it."""

import fnmatch
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import fields

from ._genome import Genome, check_genome
from ._numbers import as_integer
from ._plan import Generated, Plan

DEFAULT_TILE = (64, 64)
GENOME_OPTIONS = tuple(f.name for f in fields(Genome))
OPTIONS = ("tile", "generate", "center", *GENOME_OPTIONS)

Rules = list[tuple[str, dict[str, object]]]


def check_tile(where: str, tile: object, call: str = "gb.plan") -> tuple[int, int] | str:
    """`tile` as `"full"` or `(th, tw)` in Python ints; raises, naming `call` and `where`,
    unless it is one of them."""
    if isinstance(tile, str) and tile == "full":
        return "full"
    pair = isinstance(tile, Sequence) and not isinstance(tile, str) and len(tile) == 2
    sizes = tuple(map(as_integer, tile)) if pair else ()
    wanted = f"{call}: {where} must be (th, tw) with positive integers or 'full', got {tile!r}."
    if (pair and None in sizes) or not isinstance(tile, Sequence):  # floats, bools; a number
        raise TypeError(wanted)
    if not sizes or not all(t > 0 for t in sizes):  # another length, another string
        raise ValueError(wanted)
    return sizes


def normalise_overrides(
    overrides: Mapping[str, Mapping[str, object] | str] | None, free: Sequence[str]
) -> Rules:
    if isinstance(free, str):
        free = (free,)
    if not isinstance(free, Sequence) or not all(isinstance(p, str) for p in free):
        raise TypeError(f"gb.plan: free must be a sequence of name patterns (str), got {free!r}.")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"gb.plan: overrides must map name patterns to options, got {type(overrides).__name__}."
        )
    rules: Rules = [(p, {"generate": False}) for p in free]
    for pattern, opts in (overrides or {}).items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"gb.plan: overrides keys must be name patterns (str), got {pattern!r}."
            )
        if opts == "free":
            rules.append((pattern, {"generate": False}))
            continue
        if not isinstance(opts, Mapping):
            raise TypeError(
                f"gb.plan: overrides[{pattern!r}] must be a dict of options or 'free', "
                f"got {opts!r}."
            )
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"gb.plan: overrides[{pattern!r}] has unknown option(s) {unknown}; "
                f"known: {OPTIONS}."
            )
        opts = dict(opts)

        def label(option: str, pattern: str = pattern) -> str:
            return f"overrides[{pattern!r}][{option!r}]"

        opts = check_genome(opts, "gb.plan", label)
        for flag in ("generate", "center"):
            value = opts.get(flag, False)
            if not (isinstance(value, bool) or (flag == "generate" and value is None)):
                raise TypeError(f"gb.plan: {label(flag)} must be a bool, got {value!r}.")
        if "tile" in opts:
            opts["tile"] = check_tile(f"overrides[{pattern!r}]['tile']", opts["tile"])
            opts["explicit_tile"] = True
        rules.append((pattern, opts))
    return rules


def check_free_kept(
    free: Sequence[str], names: list[str], options: list[dict[str, object]]
) -> None:
    """Refuse a parameter that `free=` names and an override generates (`generate: True`
    after it): the two ask opposite things, and neither should win without a word."""
    patterns = (free,) if isinstance(free, str) else tuple(free)
    for name, opts in zip(names, options, strict=True):
        matched = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if matched is not None and opts["generate"] is True:
            raise ValueError(
                f"gb.plan: {name!r} matches free pattern {matched!r} and an override that sets "
                "generate=True; drop one, or give both as overrides, which apply in order "
                "({pattern: 'free'}, then {pattern: {'generate': True}})."
            )


def check_patterns(rules: Rules, names: list[str], tied: dict[str, str]) -> None:
    """Raise for a pattern that matches no parameter's name (`names`, each parameter's first);
    one matching the second name of a tied parameter (`tied`: to its first) says so."""
    for pattern, _ in rules:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            alias = next((n for n in tied if fnmatch.fnmatchcase(n, pattern)), None)
            if alias is not None:
                raise ValueError(
                    f"gb.plan: pattern {pattern!r} matches {alias!r} only, which is tied to "
                    f"{tied[alias]!r}: the plan names a tied parameter by its first name; "
                    "use that one."
                )
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(
                f"gb.plan: pattern {pattern!r} matches no parameter (parameters: {shown})."
            )


def warn_unused(rules: Rules, shaped: set[str], reasons: dict[str, str]) -> None:
    """Warn of each override whose genome options reach no parameter whose g-nets they shape
    (`shaped`: generated ones, and those `compression=` left free for what their g-nets would
    cost): every name it matches stays free whatever its g-nets (`reasons`: why, by name), so
    they change nothing."""
    for pattern, over in rules:
        options = sorted(set(over) - {"generate", "explicit_tile"})
        matched = [n for n in reasons if fnmatch.fnmatchcase(n, pattern)]
        if options and not any(fnmatch.fnmatchcase(n, pattern) for n in shaped) and matched:
            why = "; ".join(f"{n}: {reasons[n]}" for n in matched[:3])
            more = ", ..." if len(matched) > 3 else ""
            warnings.warn(
                f"gb.plan: overrides[{pattern!r}] sets {', '.join(options)}, but every parameter "
                f"it matches stays free ({why}{more}), so they change nothing.",
                UserWarning,
                stacklevel=3,
            )


def warn_dropped(rules: Rules, plan: Plan) -> None:
    """Warn of each override that asks `outputs` > 1 or `center=True` where no parameter it
    matches can take it: a convolution kernel's or a bias's g-nets emit one value per
    evaluation, and a bias (or a weight of one input per row) has no inputs to centre over."""
    for pattern, over in rules:
        matched = [p for p in plan.generated if fnmatch.fnmatchcase(p.name, pattern)]
        if not matched:
            continue  # `warn_unused`'s
        outputs = over.get("outputs", 1)
        if (
            isinstance(outputs, int)
            and outputs > 1
            and all(plan.stacks[p.stack_index].genome.outputs == 1 for p in matched)
        ):
            one_value = "emit one value per evaluation: convolution kernels and biases"
            _warn_dropped(pattern, f"outputs={outputs}", matched, one_value)
        if over.get("center") is True and not any(p.center for p in matched):
            one_input = "have no inputs to centre over: biases and weights of one input"
            _warn_dropped(pattern, "center=True", matched, one_input)


def _warn_dropped(pattern: str, option: str, matched: list[Generated], why: str) -> None:
    names = ", ".join(p.name for p in matched[:3]) + (", ..." if len(matched) > 3 else "")
    warnings.warn(
        f"gb.plan: overrides[{pattern!r}] sets {option}, but the parameters it matches "
        f"({names}) {why}; it changes nothing.",
        UserWarning,
        stacklevel=4,
    )


def resolve(name: str, base: dict[str, object], rules: Rules) -> dict[str, object]:
    opts = dict(base)
    for pattern, over in rules:
        if fnmatch.fnmatchcase(name, pattern):
            opts.update(over)
    return opts
