"""A checkpoint fuzzer: a mutated file either loads as a consistent checkpoint or raises a
`gb.CheckpointError`, and never allocates without bound.

Mutations reach every layer of the file: raw bytes, the safetensors header (sizes, dtypes,
shapes, offsets), the JSON in its metadata (plan, optimizer state, step, format) and the
tensors. Where a mutation is meant to be judged on its content (a plan field, a tensor's
dtype), the SHA-256 is recomputed so that the hash check does not hide it. A load that
succeeds must then generate every parameter at the model's shapes.

The property runs in one subprocess whose address space is capped (`RLIMIT_AS`, 2 GiB above
what it holds after setting up): a crafted plan that made `gb.load` or `gb.apply` allocate
without bound fails there, as an error that is not a `gb.CheckpointError`.
"""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import gbfunc as gb
from gbfunc._checkpoint import content_hash

EXAMPLES = 300
HEADROOM = 2 * 2**30


class Counted(nn.Module):
    """Two layers on 4x4 tiles, a norm, and an integer parameter (frozen by necessity)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 3)
        self.counts = nn.Parameter(torch.arange(3), requires_grad=False)


class Mixed(nn.Module):
    """A conv (kernel in the output) and attention (Q, K, V split) on shared g-nets."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.attn = nn.MultiheadAttention(8, 2)


BASES = {
    "counted": (Counted, {"tile": (4, 4), "hidden": 4}),
    "mixed": (Mixed, {"tile": (4, 4), "share": True, "window_in": "output", "hidden": 4}),
}


def write_bases(folder: Path) -> dict[str, bytes]:
    """A checkpoint of each base model, with optimizer state, step and meta; their bytes."""
    out = {}
    for name, (make, options) in BASES.items():
        torch.manual_seed(0)
        model = make()
        plan = gb.plan(model, **options)
        gparams = gb.init(plan)
        trainable = [t for t in torch.utils._pytree.tree_leaves(gparams) if t.requires_grad]
        opt = torch.optim.Adam(trainable, lr=1e-3)
        sum(t.square().sum() for t in trainable).backward()
        opt.step()
        path = folder / f"{name}.safetensors"
        gb.save(path, gparams, plan, opt_state=opt.state_dict(), step=3, meta={"run": [1, 2]})
        gb.load(path, make())  # the unmutated file loads
        out[name] = path.read_bytes()
    return out


# ------------------------------------------------------------------ file surgery


def split(data: bytes) -> tuple[dict, bytes]:
    """(safetensors header, tensor bytes) of a whole file."""
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def contents(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = safetensors.torch.load(data)
    return tensors, split(data)[0]["__metadata__"]


def rehashed(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A file of `tensors` and `metadata` whose SHA-256 matches them."""
    metadata = {**metadata, "sha256": content_hash(tensors, metadata)}
    return safetensors.torch.save(tensors, metadata)


# ------------------------------------------------------------------ strategies

INTS = st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 4, 5, 8, 9, 65536, 2**31, 2**64, 10**30])
FLOATS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 0.5, 1e-300, 1e300])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=4)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=6,
)


def nearby(draw, value: object) -> object:
    """A value that is wrong in a small way: an off-by-one, a sign, a type, or anything."""
    if isinstance(value, bool):
        return draw(st.sampled_from([not value, 0, 1, None]))
    if isinstance(value, int):
        return draw(
            st.sampled_from([value + 1, value - 1, -value, 0, 2 * value + 1, float(value)]) | INTS
        )
    if isinstance(value, float):
        return draw(st.sampled_from([0.0, -value, 2 * value]) | FLOATS)
    if isinstance(value, str):
        return draw(st.sampled_from(["", value + "x", value.upper()]) | st.text(max_size=6))
    return draw(VALUES)


def mutate_json(draw, node: object) -> object:
    """`node` with one element, found by a random walk, replaced, removed or duplicated."""
    if isinstance(node, dict) and node and draw(st.integers(0, 7)):
        key = draw(st.sampled_from(sorted(node)))
        action = draw(st.sampled_from(["descend", "descend", "remove", "add"]))
        if action == "remove":
            return {k: v for k, v in node.items() if k != key}
        if action == "add":
            return {**node, draw(st.text(max_size=4)): draw(VALUES)}
        return {**node, key: mutate_json(draw, node[key])}
    if isinstance(node, list) and node and draw(st.integers(0, 7)):
        i = draw(st.integers(0, len(node) - 1))
        action = draw(st.sampled_from(["descend", "descend", "remove", "duplicate", "swap"]))
        if action == "remove":
            return node[:i] + node[i + 1 :]
        if action == "duplicate":
            return [*node[: i + 1], node[i], *node[i + 1 :]]
        if action == "swap":
            j = draw(st.integers(0, len(node) - 1))
            node = list(node)
            node[i], node[j] = node[j], node[i]
            return node
        return [*node[:i], mutate_json(draw, node[i]), *node[i + 1 :]]
    return nearby(draw, node)


def mutate_bytes(draw, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "set", "truncate", "insert", "size"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if action == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif action == "truncate":
            del data[i:]
        elif action == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:  # the header length
            data[:8] = struct.pack(
                "<Q", draw(st.integers(0, 2**64 - 1) | INTS.filter(lambda n: 0 <= n < 2**64))
            )
    return bytes(data)


def mutate_header(draw, data: bytes) -> bytes:
    """A changed safetensors header entry (dtype, shape, offsets); the hash is left as is."""
    header, body = split(data)
    key = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    if field == "dtype":
        value = draw(
            st.sampled_from(["F16", "F64", "I64", "I8", "BOOL", "U8", "BF16", "X"]) | VALUES
        )
    else:
        value = mutate_json(draw, header[key][field])
    header[key] = {**header[key], field: value}
    return join(header, body)


def mutate_plan(draw, data: bytes) -> bytes:
    """A changed plan field, with the hash recomputed."""
    return mutate_metadata(draw, data, "plan")


def mutate_metadata(draw, data: bytes, key: str | None = None) -> bytes:
    """A changed metadata entry (its JSON walked and mutated), with the hash recomputed."""
    tensors, metadata = contents(data)
    key = key or draw(st.sampled_from(sorted(metadata)))
    if draw(st.integers(0, 9)) == 0:  # deeply nested or not JSON at all
        n = draw(st.sampled_from([10, 900, 5000]))
        metadata[key] = draw(st.sampled_from(["[" * n + "]" * n, '{"a":' * n, "nope"]))
    else:
        try:
            value = json.loads(metadata[key])
        except ValueError:  # a plain string: format, versions
            value = metadata[key]
        metadata[key] = json.dumps(mutate_json(draw, value)) if key != "sha256" else "0" * 64
    return rehashed(tensors, metadata)


def mutate_tensors(draw, data: bytes) -> bytes:
    """A changed, removed, renamed or added tensor, with the hash recomputed."""
    tensors, metadata = contents(data)
    key = draw(st.sampled_from(sorted(tensors)))
    t = tensors[key]
    action = draw(st.sampled_from(["dtype", "reshape", "slice", "remove", "rename", "add"]))
    if action == "dtype":
        dtypes = [
            torch.float16,
            torch.float64,
            torch.bfloat16,
            torch.int64,
            torch.int32,
            torch.bool,
        ]
        tensors[key] = t.to(draw(st.sampled_from(dtypes)))
    elif action == "reshape":
        tensors[key] = t.reshape(draw(st.sampled_from([(-1,), (1, -1), (-1, 1), (*t.shape, 1)])))
    elif action == "slice":
        tensors[key] = t.reshape(-1)[: draw(st.integers(0, max(0, t.numel() - 1)))].clone()
    elif action == "remove":
        del tensors[key]
    elif action == "rename":
        tensors[draw(st.sampled_from([key + "x", "evil", "stacks/x/w_in"]))] = tensors.pop(key)
    else:
        tensors[draw(st.sampled_from(["evil", "opt_state/99", key + "/x"]))] = t.clone()
    return rehashed(tensors, metadata)


MUTATIONS = {
    "bytes": mutate_bytes,
    "header": mutate_header,
    "metadata": mutate_metadata,
    "plan": mutate_plan,
    "tensors": mutate_tensors,
}


# ------------------------------------------------------------------ the property


def run(folder: Path, examples: int) -> None:
    """Set up, cap the address space, then check `examples` mutated files."""
    import resource

    bases = write_bases(folder)
    path = folder / "fuzzed.safetensors"
    status = Path("/proc/self/status").read_text()
    held = 1024 * int(next(ln for ln in status.splitlines() if ln.startswith("VmSize:")).split()[1])
    resource.setrlimit(resource.RLIMIT_AS, (held + HEADROOM, resource.RLIM_INFINITY))

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.data())
    def loads_or_refuses(data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(sorted(bases)), label="base")
        kind = data.draw(st.sampled_from([*MUTATIONS, "plan", "plan"]), label="mutation")
        path.write_bytes(MUTATIONS[kind](data.draw, bases[base]))
        make = BASES[base][0]
        try:
            ckpt = gb.load(path, make())
        except gb.CheckpointError:
            return
        params = gb.apply(ckpt.gparams, ckpt.plan)
        for name, p in make().named_parameters():
            assert params[name].shape == p.shape, name

    loads_or_refuses()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc are Linux's")
def test_mutated_checkpoints_load_or_raise_a_checkpoint_error(tmp_path):
    code = (
        "import pathlib, runpy, sys; "
        f"runpy.run_path({__file__!r})['run'](pathlib.Path(sys.argv[1]), {EXAMPLES})"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
