"""Checkpoints rewritten as an attacker would: contents changed, SHA-256 recomputed.

Shared by the tests of `gb.load`'s checks (the hash alone must not make a file trusted).
"""

import json
from collections.abc import Callable

import safetensors
import safetensors.torch

from gbfunc._checkpoint import content_hash

Change = Callable[[dict, dict], None]  # (tensors, metadata) -> None, in place


def forge(path, change: Change) -> None:
    """Rewrite a checkpoint with `change(tensors, metadata)`, then recompute its SHA-256."""
    with safetensors.safe_open(path, "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
    change(tensors, metadata)
    metadata["sha256"] = content_hash(tensors, metadata)
    safetensors.torch.save_file(tensors, path, metadata)


def in_plan(edit: Callable[[dict], None]) -> Change:
    """A `Change` that edits the plan's JSON (a dict) in place."""

    def change(tensors: dict, metadata: dict) -> None:
        plan = json.loads(metadata["plan"])
        edit(plan)
        metadata["plan"] = json.dumps(plan)

    return change
