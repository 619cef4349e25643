"""Device arguments, checked where a call takes them, before it reads or draws anything.

torch's own errors for a bad device name no call or parameter ("Expected one of cpu, cuda,
... device type at start of device string: gpu"; an `AssertionError` "Torch not compiled with
CUDA enabled"), and `gb.load` would meet them only after reading the whole file.
"""

import textwrap

import torch


def checked_device(call: str, name: str, value: object) -> torch.device | None:
    """`value` (a `torch.device`, a string such as `"cuda:1"`, an int CUDA index, or None) as
    a `torch.device` (None stays None); a `TypeError` or `ValueError` naming `call` and
    `name` unless it names a device this process can place tensors on."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, torch.device | str | int):
        raise TypeError(
            f"{call}: {name} must be a torch.device, a string such as 'cpu' or 'cuda:0', or "
            f"None, got {type(value).__name__}."
        )
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{call}: {name}={value!r:.100} is not a device ({_first_line(error)})."
        ) from None
    if device.type == "meta":
        return device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # no such backend, or no such index
        raise ValueError(
            f"{call}: {name}={value!r:.100} is not available in this process "
            f"({_first_line(error)})."
        ) from None
    return device


def _first_line(error: BaseException) -> str:
    """The first line of torch's message, cut to 200 characters (some list every dispatch key)."""
    lines = str(error).strip().splitlines()
    return textwrap.shorten(lines[0], 200).rstrip(".") if lines else type(error).__name__
