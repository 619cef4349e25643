"""`gb.save` / `gb.load`: compressed checkpoints in one safetensors file.

The tensors (g-net stacks, free and frozen parameters, the p-net's buffers, optimizer state)
are safetensors entries; the plan, the optimizer state's structure, `step` and `meta` are
JSON in the safetensors metadata header, next to a format version, the writing library
versions and a SHA-256 over every tensor (name, dtype, shape, bytes) and every metadata
entry. Loading reads the file once, checks it, and builds new tensors: nothing is executed,
nothing is unpickled, and nothing is mutated but the model's buffers, once all is checked.

The SHA-256 detects accidental damage (a flipped bit, a truncated copy, a hand edit that
forgot to update it); it is not a signature, and a crafted file can carry a matching one.
`gb.load` is safe on crafted files because it also checks what it reads: the file kind, the
header's size and structure, the plan against the model (`_check_plan`), and every tensor
against the plan, so a file either loads as a consistent checkpoint or raises a
`gb.CheckpointError`. `gb.save` runs the same checks (`_checkpoint_checks`) before it writes,
so that it never writes a file `gb.load` would refuse.
"""

import hashlib
import json
import os
import stat
import struct
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import safetensors.torch
import torch
from torch import Tensor, nn

from ._check_gparams import TASKS, check_gparams, expected_shapes, leaves
from ._check_model import check_module
from ._checkpoint_checks import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError as CheckpointMismatchError,  # imported from here, as the others
    CheckpointNotFoundError,
    CheckpointUnreadableError as CheckpointUnreadableError,
    CheckpointVersionError,
    buffers_to_save,
    check_checkpoint,
    check_restorable,
    checkpoint_path,
)
from ._devices import checked_device
from ._files import (
    FILE_KINDS,
    check_no_meta,
    check_readable_back,
    standalone,
    sync_dir,
    write_atomic,
)
from ._numbers import as_integer, integer
from ._plan import Plan
from ._serial import flatten, meta_fields, meta_from, plan_from_json, plan_to_json, unflatten
from ._tree import GParams
from ._version import __version__

FORMAT = "gbfunc.checkpoint"
FORMAT_VERSION = 3  # 2: plan fields renamed (`kernel` -> `window_in`, ...); 3: p-net buffers
READABLE_VERSIONS = (1, 2, 3)  # version 1 files load through `plan_from_json`'s migration
BUFFERS = "buffers/"  # prefix of the p-net's buffers among the file's tensors


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
    buffers: nn.Module | Mapping[str, Tensor] | None = None,
    opt_state: object = None,
    step: int | None = None,
    meta: dict[str, Any] | None = None,
) -> None:
    """Write a compressed checkpoint atomically (temporary file, fsync, rename).

    Args:
        path: Target file, conventionally `*.safetensors`.
        gparams: From `gb.init(plan)` (or trained from it).
        plan: The plan that made `gparams`.
        buffers: The p-net's buffers (BatchNorm running statistics and the like), which are
            state but not parameters: a module (its persistent buffers, as in its
            `state_dict`; a `gb.Bottleneck`: its p-net's) or `{name: tensor}`. Default:
            those of the plan's model (the one `gb.plan` was given, `b.pnet` for `b.plan`,
            the model passed to `gb.load` for the plan it returns), while it is alive; if
            it is gone, none, with a warning where it had some. `{}` stores none. They are
            checked against that model's as `gb.load` checks them. `gb.load` restores them
            into the model it is given.
        opt_state: An optimizer's `state_dict()` or any pytree of tensors, numbers, strings,
            None, lists, tuples and dicts (str or int keys).
        step: Training step, an int >= 0.
        meta: Dicts (str or int keys), lists, tuples, strings, numbers, booleans, None;
            `gb.load` returns it equal.

    Examples:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> gparams = gb.init(plan)
        >>> opt = torch.optim.AdamW(gb.trainable_leaves(gparams))
        >>> state = opt.state_dict()
        >>> gb.save("ckpt.safetensors", gparams, plan, opt_state=state, step=100)
        >>> gparams, plan, opt_state, step, meta = gb.load("ckpt.safetensors", model)
        >>> step, sorted(opt_state)
        (100, ['param_groups', 'state'])
    """
    path = checkpoint_path(path, "gb.save")
    check_gparams(gparams, plan, "gb.save")
    step = integer("gb.save", "step", step, minimum=0, optional=True)
    kept_meta = meta_fields(meta, "gb.save")
    labelled = leaves(gparams, plan)
    check_no_meta(labelled, "gb.save")
    kept = buffers_to_save(buffers, plan, "gb.save")
    skeleton, opt_tensors = flatten(opt_state, "opt_state", "gb.save: opt_state")
    check_no_meta({f"opt_state tensor {k!r}": t for k, t in opt_tensors.items()}, "gb.save")
    names = ["/".join(keys) for keys in expected_shapes(plan)]  # same order as `labelled`
    stored = {BUFFERS + name: t for name, t in kept.items()}
    tensors = standalone(
        {**dict(zip(names, labelled.values(), strict=True)), **stored, **opt_tensors}
    )
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "gbfunc_version": __version__,
        "torch_version": torch.__version__,
        "plan": plan_to_json(plan),
        "opt_state": json.dumps(skeleton),
        "step": json.dumps(step),
        **{key: json.dumps(value, sort_keys=True) for key, value in kept_meta.items()},
    }
    metadata["sha256"] = content_hash(tensors, metadata)
    write_file(path, tensors, metadata, "gb.save")


def write_file(path: str, tensors: dict[str, Tensor], metadata: dict[str, str], where: str) -> None:
    """Write a safetensors file atomically; a failure is a `CheckpointError` naming `path`
    (not the temporary file) and the reason, and leaves any previous file there unchanged."""

    def write(tmp: str) -> None:
        safetensors.torch.save_file(tensors, tmp, metadata)

    if path.endswith(("/", os.sep)):
        raise CheckpointError(f"{where}: {path}: names a directory; give a file name.")
    check_readable_back({f"{where}: entry {name!r}": t for name, t in tensors.items()})
    try:
        written = write_atomic(path, write)
    except (OSError, safetensors.SafetensorError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(
            f"{where}: {path}: cannot be written ({reason}); any previous file there is unchanged."
        ) from e
    try:  # the file is whole and in place: only the rename's durability is left
        sync_dir(os.path.dirname(written))
    except OSError as e:
        warnings.warn(
            f"{where}: {path}: written whole, but its folder could not be synced "
            f"({e.strerror or e}); a crash of the machine soon after may bring back the file "
            "it replaced.",
            RuntimeWarning,
            stacklevel=3,
        )


def load(
    path: str | os.PathLike, model: nn.Module, *, device: torch.device | str | None = None
) -> Checkpoint:
    """Read and verify a checkpoint written by `gb.save`, for `model`.

    Checks, in order: the path is a regular file (never a device or FIFO, which could be
    endless or block); it is a whole gbfunc checkpoint of a known format version, its
    header bounded before it is read; its SHA-256 matches; its plan is well formed and fits
    `model` (every field, against the model's shapes, so that whatever it sizes is bounded
    by the model); its tensors are the ones that plan and the optimizer state need, with
    their dtypes. Each failure raises a `gb.CheckpointError` subclass naming the file; on
    success the p-net buffers stored with it (BatchNorm statistics and the like) are copied
    into `model`'s, as `load_state_dict` would (cast to a floating buffer's dtype), and new
    tensors are returned for the rest; on failure nothing is touched, even when a buffer of
    `model` cannot be written (the ones written before it are put back).

    The SHA-256 detects damage (a flipped bit, a truncated copy), not forgery: anyone can
    write a file with a matching hash. What makes a crafted file safe to load is the
    checking of its contents above, not the hash.

    Args:
        path: File written by `gb.save`.
        model: The p-net the checkpoint is for: its names and shapes are checked, and its
            buffers receive the stored ones.
        device: Where to put the tensors (default: CPU).

    Returns:
        `Checkpoint(gparams, plan, opt_state, step, meta)`; trainable leaves of `gparams`
            require grad, as from `gb.init`; the plan names `model` as its model, so that
            `gb.save(path, gparams, plan)` stores `model`'s buffers again.

    Examples:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> meta = {"lr": 1e-3}
        >>> gb.save("ckpt.safetensors", gb.init(plan), plan, step=100, meta=meta)
        >>> ckpt = gb.load("ckpt.safetensors", model)
        >>> ckpt.step, ckpt.meta, ckpt.plan == plan
        (100, {'lr': 0.001}, True)
        >>> out = torch.func.functional_call(
        ...     model, gb.apply(ckpt.gparams, ckpt.plan), (torch.randn(2, 64),)
        ... )
        >>> try:  # a checkpoint of another model is refused, naming the difference
        ...     gb.load("ckpt.safetensors", nn.Linear(64, 48))
        ... except gb.CheckpointMismatchError as e:
        ...     print(e)
        gb.load: ckpt.safetensors: parameter 'weight' has shape (32, 64) in the
        checkpoint but (48, 64) in the model.
    """
    ckpt, buffers = read(path, model, "gb.load", device=device)
    restore_buffers(model, buffers, f"gb.load: {os.fspath(path)}")
    return ckpt


def read(
    path: str | os.PathLike,
    model: nn.Module,
    where: str,
    *,
    device: torch.device | str | None = None,
) -> tuple[Checkpoint, dict[str, Tensor]]:
    """`gb.load` without its one side effect: the checkpoint and the p-net buffers it holds,
    checked against `model`'s, for a caller that has more to check before restoring them."""
    device = checked_device(where, "device", device)
    check_module(model, where)
    path = checkpoint_path(path, where)
    where = f"{where}: {path}"
    tensors, metadata = _verified(path, where)
    plan, skeleton, step, meta = _header(metadata, where)
    # by p-net name; a file may hold fewer than the model has (one before version 3: none)
    keys = [k for k in tensors if k.startswith(BUFFERS)]
    stored = {k.removeprefix(BUFFERS): tensors.pop(k) for k in keys}
    check_checkpoint(plan, model, stored, where, corrupt=CheckpointCorruptError)
    check_restorable(model, stored, where)
    gparams, opt_state = _contents(tensors, plan, skeleton, where, device)
    return Checkpoint(gparams, plan.naming(model), opt_state, step, meta), stored


def restore_buffers(model: nn.Module, buffers: dict[str, Tensor], where: str) -> None:
    """Copy `buffers` (checked by `read`) into `model`'s, in place (aliases see them too),
    all or none: if one cannot be written (an expanded view, an inference tensor), those
    written before it get their values back and a `CheckpointError` names it."""
    written: list[tuple[Tensor, Tensor]] = []
    with torch.no_grad():
        for name, value in buffers.items():
            target = model.get_buffer(name)
            try:
                before = target.clone()
                target.copy_(value)
            except RuntimeError as e:
                for done, old in reversed(written):
                    done.copy_(old)
                raise CheckpointError(
                    f"{where}: the model's buffer {name!r} cannot be written ({e!s:.200}); "
                    "the model is unchanged. Give it a buffer of its own (e.g. .clone()), as "
                    "load_state_dict needs too."
                ) from e
            written.append((target, before))


def _verified(path: str, where: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The file's tensors and metadata, once it is known to be a whole checkpoint."""
    data = _read_file(path, where)
    metadata = _read_metadata(data, where)
    try:
        tensors = safetensors.torch.load(data)
        digest = content_hash(tensors, metadata)
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise CheckpointCorruptError(f"{where}: the file is damaged ({e}).") from None
    if digest != metadata.get("sha256"):
        raise CheckpointCorruptError(
            f"{where}: SHA-256 mismatch: the file was altered or damaged after it was written."
        )
    return tensors, metadata


def _header(metadata: dict[str, str], where: str) -> tuple[Plan, Any, int | None, Any]:
    """The plan, optimizer-state skeleton, step and meta the metadata holds."""
    try:
        plan = plan_from_json(metadata["plan"], int(metadata["format_version"]))
        skeleton, step, meta = (json.loads(metadata[k]) for k in ("opt_state", "step", "meta"))
        if "meta_tagged" in metadata:  # a meta with tuples or int keys (`meta_fields`)
            meta = meta_from({"meta_tagged": json.loads(metadata["meta_tagged"])})
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable metadata ({e!s:.200}).") from None
    if step is not None and not (as_integer(step) is not None and step >= 0):
        raise CheckpointCorruptError(
            f"{where}: step must be an int >= 0 or null, got {step!r:.100}."
        )
    return plan, skeleton, step, meta


def _contents(
    tensors: dict[str, Tensor],
    plan: Plan,
    skeleton: Any,
    where: str,
    device: torch.device | str | None,
) -> tuple[GParams, Any]:
    """`(gparams, opt_state)` from the file's tensors: exactly those the plan and skeleton use."""
    used: set[str] = set()

    def tensor(key: str) -> Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise ValueError(f"tensor {key!r} is missing")
        used.add(key)
        return tensors[key]

    def opt_tensor(key: str) -> Tensor:
        if not (isinstance(key, str) and key.startswith("opt_state/")):
            raise ValueError(f"the optimizer state refers to tensor {key!r}")
        return tensor(key).to(device) if device is not None else tensor(key)

    loaded: GParams = {"stacks": {}, "free": {}, "frozen": {}}
    try:
        for keys in expected_shapes(plan):
            node = loaded
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = tensor("/".join(keys))
        check_gparams(loaded, plan, "gparams")  # shapes and dtypes, before requires_grad
        opt_state = unflatten(skeleton, opt_tensor)
        if unused := sorted(set(tensors) - used):
            raise ValueError(f"tensor {unused[0]!r} belongs to neither the plan nor opt_state")
    except (TypeError, ValueError, RecursionError) as e:  # a writer other than gb.save
        raise CheckpointCorruptError(f"{where}: inconsistent contents ({e!s:.300}).") from None

    def finish(t: Tensor, trainable: bool) -> Tensor:
        return (t.to(device) if device is not None else t).requires_grad_(trainable)

    stacks = loaded["stacks"]
    gparams: GParams = {
        "stacks": {k: {n: finish(t, True) for n, t in s.items()} for k, s in stacks.items()},
        "free": {k: finish(t, True) for k, t in loaded["free"].items()},
        "frozen": {k: finish(t, False) for k, t in loaded["frozen"].items()},
    }
    if TASKS in loaded:
        gparams[TASKS] = finish(loaded[TASKS], True)
    return gparams, opt_state


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


# safetensors refuses longer headers itself; bounding it first keeps a file whose first 8
# bytes are not a header length (text, a zip from torch.save) from being read as one.
MAX_HEADER = 100_000_000


def _read_file(path: str, where: str) -> bytes:
    """The bytes of `path`, which must be a regular file: a device or FIFO could be endless or
    block forever, so it is refused before it is opened (and again after, against a swap)."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
        if kind == stat.S_IFDIR:
            raise IsADirectoryError
        _check_regular(kind, where)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"{where}: no such file.") from None
    except IsADirectoryError:
        raise CheckpointUnreadableError(
            f"{where}: is a directory, not a checkpoint file."
        ) from None
    except OSError as e:
        raise CheckpointUnreadableError(f"{where}: cannot be read ({e.strerror}).") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        _check_regular(stat.S_IFMT(info.st_mode), where)
        try:
            return f.read(info.st_size)
        except OSError as e:
            raise CheckpointUnreadableError(f"{where}: cannot be read ({e.strerror}).") from None


def _check_regular(kind: int, where: str) -> None:
    if kind != stat.S_IFREG:
        what = FILE_KINDS.get(kind, "not a file")
        raise CheckpointCorruptError(
            f"{where}: not a regular file ({what}); a checkpoint is a file written by gb.save."
        )


def _read_metadata(data: bytes, where: str) -> dict[str, str]:
    """The safetensors header's metadata, after checking the file is whole and ours."""
    truncated = f"{where}: the file is truncated: it has {len(data)} bytes"
    if len(data) < 8:
        raise CheckpointCorruptError(f"{truncated}, too few for a header.")
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER or data[8:9] not in (b"{", b""):
        raise CheckpointCorruptError(
            f"{where}: not a gbfunc checkpoint (not a safetensors file: its first 8 bytes are "
            "not the length of a JSON header); gb.save writes those."
        )
    if 8 + size > len(data):
        raise CheckpointCorruptError(f"{truncated}, its header needs {8 + size}.")
    try:
        header = json.loads(data[8 : 8 + size])  # an object: it starts with "{"
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError("metadata entries must be strings")
        end = max((_tensor_end(k, v) for k, v in header.items()), default=0)
    except (ValueError, TypeError, RecursionError) as e:  # RecursionError: deeply nested JSON
        raise CheckpointCorruptError(f"{where}: the header is damaged ({e!s:.200}).") from None
    if 8 + size + end > len(data):
        raise CheckpointCorruptError(f"{truncated}, its tensors need {8 + size + end}.")
    if metadata.get("format") != FORMAT:
        raise CheckpointCorruptError(
            f"{where}: not a gbfunc checkpoint (no '{FORMAT}' header); gb.save writes those."
        )
    version, writer = metadata.get("format_version"), metadata.get("gbfunc_version")
    if version not in [str(v) for v in READABLE_VERSIONS]:
        raise CheckpointVersionError(
            f"{where}: format version {version} (written by gbfunc {writer}); this gbfunc "
            f"{__version__} reads versions {READABLE_VERSIONS}. Use a matching gbfunc."
        )
    return metadata


def _tensor_end(key: str, entry: object) -> int:
    """Where tensor `key`'s bytes end, from its header entry; raises `TypeError` if malformed."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    ok = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(as_integer(o) is not None for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    )
    if not ok:
        raise TypeError(
            f"tensor {key!r:.100} has data_offsets {offsets!r:.100}; expected [begin, end]"
        )
    return offsets[1]
