"""`gb.save` / `gb.load`: compressed checkpoints in one safetensors file.

The tensors (g-net stacks, free and frozen parameters, optimizer state) are safetensors
entries; the plan, the optimizer state's structure, `step` and `meta` are JSON in the
safetensors metadata header, next to a format version, the writing library versions and a
SHA-256 over every tensor (name, dtype, shape, bytes) and every metadata entry. Loading
reads the file once, checks it, and builds new tensors: nothing is executed, nothing is
mutated, nothing is unpickled.
"""

import hashlib
import json
import os
import stat
import struct
from typing import Any, NamedTuple

import safetensors.torch
import torch
from torch import Tensor, nn

from ._apply import GParams
from ._checks import check_gparams, expected_shapes, leaves
from ._files import check_no_meta, standalone, write_atomic
from ._model import check_matches, check_module
from ._plan import Plan
from ._serial import flatten, plan_from_json, plan_to_json, unflatten
from ._validate import check_plan

FORMAT = "gbfunc.checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, altered (hash mismatch) or not a gbfunc checkpoint."""


class CheckpointVersionError(CheckpointError):
    """The file was written in a format version this gbfunc cannot read."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was made for a different model (or different g-nets)."""


class Checkpoint(NamedTuple):
    """What `gb.load` returns; unpacks as `gparams, plan, opt_state, step, meta = gb.load(...)`."""

    gparams: GParams
    plan: Plan
    opt_state: Any
    step: int | None
    meta: dict[str, Any] | None


def save(
    path: str | os.PathLike,
    gparams: GParams,
    plan: Plan,
    *,
    opt_state: object = None,
    step: int | None = None,
    meta: dict[str, Any] | None = None,
) -> None:
    """Write a compressed checkpoint atomically (temporary file, fsync, rename).

    Args:
        path: Target file, conventionally `*.safetensors`.
        gparams: From `gb.init(plan)` (or trained from it).
        plan: The plan that made `gparams`.
        opt_state: An optimizer's `state_dict()` or any pytree of tensors, numbers, strings,
            None, lists, tuples and dicts (str or int keys).
        step: Training step, an int >= 0.
        meta: Anything JSON can hold.

    Example:
        >>> gb.save("ckpt.safetensors", gparams, plan, opt_state=opt.state_dict(), step=100)
        >>> gparams, plan, opt_state, step, meta = gb.load("ckpt.safetensors", model)
    """
    path = os.fspath(path)
    check_gparams(gparams, plan, "gb.save")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise TypeError(f"gb.save: step must be an int >= 0 or None, got {step!r}.")
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"gb.save: meta must be JSON-serialisable: {e}.") from None
    labelled = leaves(gparams, plan)
    check_no_meta(labelled, "gb.save")
    skeleton, opt_tensors = flatten(opt_state, "opt_state", "gb.save: opt_state")
    check_no_meta({f"opt_state tensor {k!r}": t for k, t in opt_tensors.items()}, "gb.save")
    names = ["/".join(keys) for keys in expected_shapes(plan)]  # same order as `labelled`
    tensors = standalone({**dict(zip(names, labelled.values(), strict=True)), **opt_tensors})
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "gbfunc_version": _gbfunc_version(),
        "torch_version": torch.__version__,
        "plan": plan_to_json(plan),
        "opt_state": json.dumps(skeleton),
        "step": json.dumps(step),
        "meta": meta_json,
    }
    metadata["sha256"] = content_hash(tensors, metadata)
    write_atomic(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata))


def load(
    path: str | os.PathLike, model: nn.Module, *, device: torch.device | str | None = None
) -> Checkpoint:
    """Read and verify a checkpoint written by `gb.save`, for `model`.

    Checks, in order: the file exists; it is a whole gbfunc checkpoint of a known format
    version; its SHA-256 matches; its parameters match `model`'s names and shapes. Each
    failure raises its own `gb.CheckpointError` subclass; on success, new tensors are
    returned and nothing else is touched.

    Args:
        path: File written by `gb.save`.
        model: The p-net the checkpoint is for (only names and shapes are read).
        device: Where to put the tensors (default: CPU).

    Returns:
        `Checkpoint(gparams, plan, opt_state, step, meta)`; trainable leaves of `gparams`
        require grad, as from `gb.init`.
    """
    check_module(model, "gb.load")
    path = os.fspath(path)
    where = f"gb.load: {path}"
    data = _read_regular_file(path, where)
    metadata = _read_metadata(data, where)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise CheckpointCorruptError(f"{where}: the file is damaged ({e}).") from None
    if content_hash(tensors, metadata) != metadata.get("sha256"):
        raise CheckpointCorruptError(
            f"{where}: SHA-256 mismatch: the file was altered or damaged after it was written."
        )
    try:
        plan = plan_from_json(metadata["plan"])
        skeleton, step, meta = (json.loads(metadata[k]) for k in ("opt_state", "step", "meta"))
    except (KeyError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable metadata ({e!r:.200}).") from None
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise CheckpointCorruptError(f"{where}: step must be an int >= 0 or null, got {step!r}.")
    check_matches(plan, model, where, "the checkpoint", CheckpointMismatchError)
    try:
        check_plan(plan, where)
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(f"{e} The plan is not one gb.plan makes.") from None

    def tensor(key: str) -> Tensor:
        if key not in tensors:
            raise ValueError(f"tensor {key!r} is missing")
        return tensors[key].to(device) if device is not None else tensors[key]

    gparams: GParams = {"stacks": {}, "free": {}, "frozen": {}}
    try:
        for keys in expected_shapes(plan):
            node = gparams
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = tensor("/".join(keys)).requires_grad_(keys[0] != "frozen")
        check_gparams(gparams, plan, "gparams")
        opt_state = unflatten(skeleton, tensor)
    except (TypeError, ValueError, RuntimeError, RecursionError) as e:  # a writer other than
        # gb.save (its hash can still match): e.g. requires_grad on an integer tensor
        raise CheckpointCorruptError(f"{where}: inconsistent contents ({e}).") from None
    return Checkpoint(gparams, plan, opt_state, step, meta)


def content_hash(tensors: dict[str, Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, then every metadata entry."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(json.dumps([key, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    entries = {k: v for k, v in metadata.items() if k != "sha256"}
    h.update(json.dumps(entries, sort_keys=True).encode())
    return h.hexdigest()


# A safetensors header is JSON and starts with "{"; gb.save's are a few kB to a few MB.
MAX_HEADER = 100 * 2**20


def _read_regular_file(path: str, where: str) -> bytes:
    """The bytes of `path`, refusing anything but a regular file before opening it.

    `os.stat` does not block, so a FIFO or a device (`/dev/zero`) is refused instead of
    hanging or reading until memory runs out.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where}: no such file.") from None
    except OSError as e:
        raise CheckpointNotFoundError(f"{where}: cannot be read ({e.strerror}).") from None
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointNotFoundError(f"{where}: is a directory, not a checkpoint file.")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointCorruptError(
            f"{where}: not a gbfunc checkpoint: not a regular file (a pipe, socket or device)."
        )
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CheckpointNotFoundError(f"{where}: cannot be read ({e.strerror}).") from None


def _read_metadata(data: bytes, where: str) -> dict[str, str]:
    """The safetensors header's metadata, after checking the file is whole and ours."""
    truncated = f"{where}: the file is truncated: it has {len(data)} bytes"
    if len(data) < 8:
        raise CheckpointCorruptError(f"{truncated}, too few for a header.")
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER or data[8:9] != b"{":
        raise CheckpointCorruptError(
            f"{where}: not a gbfunc checkpoint: not a safetensors file (gb.save writes those)."
        )
    if 8 + size > len(data):
        raise CheckpointCorruptError(f"{truncated}, its header needs {8 + size}.")
    try:
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata entries must be strings")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: the header is damaged ({e!r:.200}).") from None
    except OverflowError:
        raise CheckpointCorruptError(
            f"{where}: the header is damaged (an offset overflows)."
        ) from None
    if 8 + size + end > len(data):
        raise CheckpointCorruptError(f"{truncated}, its tensors need {8 + size + end}.")
    if metadata.get("format") != FORMAT:
        raise CheckpointCorruptError(
            f"{where}: not a gbfunc checkpoint (no '{FORMAT}' header); gb.save writes those."
        )
    version, writer = metadata.get("format_version"), metadata.get("gbfunc_version")
    if version != str(FORMAT_VERSION):
        raise CheckpointVersionError(
            f"{where}: format version {version} (written by gbfunc {writer}); this gbfunc "
            f"{_gbfunc_version()} reads version {FORMAT_VERSION}. Use a matching gbfunc."
        )
    return metadata


def _gbfunc_version() -> str:
    from . import __version__

    return __version__
