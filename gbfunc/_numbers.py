"""What counts as a number in gbfunc's arguments, checked in one place.

Any real number a caller may hold is taken: Python's, numpy's, a `fractions.Fraction`, a 0-dim
tensor. Each comes back as a Python `int` or `float`, the value the package then uses (in
arithmetic, as dict keys, in JSON). Bools are never numbers here, and inf and NaN are refused
wherever a number is checked. Messages read `"CALL: NAME must be ..., got VALUE."`, with
`TypeError` for a value of the wrong kind and `ValueError` for one out of range.
"""

import math
import numbers

import torch


def as_integer(value: object) -> int | None:
    """`value` as a Python int if it is an integer (`numbers.Integral` or an integer 0-dim
    tensor), else None."""
    value = _scalar(value)
    return int(value) if isinstance(value, numbers.Integral) else None


def as_finite(value: object) -> int | float | None:
    """`value` as a Python int (integers) or float (other reals) if it is a real number with
    a finite float value (`numbers.Real` or a real 0-dim tensor), else None."""
    value = _scalar(value)
    if not isinstance(value, numbers.Real) or _float(value) is None:
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def integer(
    call: str,
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
) -> int | None:
    """`value` as a Python int (None if `optional` and it is None); raises, naming `call`
    and `name`, unless it is an integer in `[minimum, maximum]`."""
    if optional and value is None:
        return None
    if maximum is not None:
        wanted = f"an integer in [{_shown(minimum)}, {_shown(maximum)}]"
    else:
        wanted = "an integer" + ("" if minimum is None else f" >= {minimum}")
    wanted += " or None" if optional else ""
    number = as_integer(value)
    if number is None:
        raise TypeError(f"{call}: {name} must be {wanted}, got {value!r:.100}.")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{call}: {name} must be {wanted}, got {value!r:.100}.")
    return number


def real(
    call: str,
    name: str,
    value: object,
    *,
    above: float | None = None,
    minimum: float | None = None,
    optional: bool = False,
) -> int | float | None:
    """`value` as a Python int (integers) or float (None if `optional` and it is None);
    raises, naming `call` and `name`, unless it is a finite real number `> above` and
    `>= minimum`."""
    if optional and value is None:
        return None
    bounds = ((">", above), (">=", minimum))
    wanted = "".join(f" {sign} {b}" for sign, b in bounds if b is not None)
    wanted += " or None" if optional else ""
    scalar = _scalar(value)
    if not isinstance(scalar, numbers.Real):
        raise TypeError(f"{call}: {name} must be a number{wanted}, got {value!r:.100}.")
    number = as_finite(scalar)
    if number is None:
        raise ValueError(f"{call}: {name} must be a finite number{wanted}, got {value!r:.100}.")
    if (above is not None and number <= above) or (minimum is not None and number < minimum):
        raise ValueError(f"{call}: {name} must be a number{wanted}, got {value!r:.100}.")
    return number


def _scalar(value: object) -> object:
    """A 0-dim real tensor's value as a Python number, None for a bool (Python's, numpy's or
    a tensor's: never a number here) or another tensor; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        real_dtype = value.dtype != torch.bool and not value.dtype.is_complex
        return value.item() if value.dim() == 0 and real_dtype and not value.is_meta else None
    return None if isinstance(value, bool) else value


def _float(value: numbers.Real) -> float | None:
    """`value` as a finite float; None for inf, NaN and values beyond float's range."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _shown(bound: int | None) -> str:
    """`bound` as a message shows it: `2**63` and `2**64 - 1`, not their digits."""
    size = abs(bound)
    if size < 2**32 or (size & (size + 1) and size & (size - 1)):
        return str(bound)
    sign = "-" if bound < 0 else ""
    if size & (size - 1) == 0:
        return f"{sign}2**{size.bit_length() - 1}"
    return f"{sign}2**{size.bit_length()} - 1"
