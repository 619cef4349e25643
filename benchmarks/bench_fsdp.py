"""Peak memory per rank of one training step: FSDP2 of the dense GPT against gbfunc with
FSDP2 of its free parameters (`gbd.ShardedFree`) and replicated g-nets.

Both runs use the same GPT, batch and AdamW on 2 gloo ranks; the dense model is sharded
block by block and at the root, as FSDP2 is meant to be used. Each rank profiles its second
step (the first creates the optimizer state): the peak bytes of CPU tensors alive during
it, from the tensors alive at its start (parameters or their shards, g-nets, optimizer
state, batch) plus the peak of the profiler's allocator count over the step (gathered
blocks, gradients, activations, generated weights, temporaries).

    python -m benchmarks.bench_fsdp [--dim 512] [--layers 8]
"""

import argparse
import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile

import gbfunc as gb
import gbfunc.dist as gbd
from benchmarks._meta import RESULTS, header_md, markdown_table, write_results
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist.testing import spawn

GENOME = {"tile": (64, 64), "hidden": 8, "outputs": 8}  # the main job's transformer genome


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct CPU storages behind `tensors` (a DTensor's local shard)."""
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.device.type == "cpu":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _peak_bytes(step: Callable[[], None], resident: Iterable[torch.Tensor]) -> int:
    """Peak bytes of CPU tensors alive during `step()`: those in `resident` at its start, plus
    the peak of what the step allocated less what it freed (the profiler's allocator
    events: parameters gathered, gradients, activations, temporaries, new optimizer state)."""
    start = _bytes(resident)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    return start + max([0, *totals])


def _batch(cfg: GPTConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab, (rows, cfg.seq + 1), generator=torch.Generator())
    return tokens[:, :-1], tokens[:, 1:]


def _dense_peak(cfg: GPTConfig, mesh, x: torch.Tensor, y: torch.Tensor) -> int:
    dense = GPT(cfg)
    for block in dense.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(dense, mesh=mesh["dp"])
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-3)

    def step() -> None:
        loss_fn(dense(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    return _peak_bytes(step, [*dense.parameters(), *state, x, y])


def _gbfunc_peak(cfg: GPTConfig, mesh, x: torch.Tensor, y: torch.Tensor) -> dict:
    model = GPT(cfg)
    plan = gb.plan(model, **GENOME)
    gparams = gb.init(plan, seed=0)
    sharded = gbd.ShardedFree(plan, model, mesh["dp"], modules=list(model.blocks.values()))
    gnets = sharded.gnet_leaves(gparams)
    sync = gbd.GradSync(gnets, mesh)
    opt = torch.optim.AdamW([*gnets, *sharded.free], lr=1e-3)

    def step() -> None:
        loss_fn(functional_call(model, sharded.apply(gparams), (x,)), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    return {
        "gbfunc": _peak_bytes(step, [*gnets, *sharded.free, *state, x, y]),
        "gbfunc_params": sum(t.numel() for t in gnets) + sum(p.numel() for p in sharded.free),
        "compression": gb.report(plan).compression,
    }


def worker(rank: int, world: int, which: str, cfg: GPTConfig, local_batch: int) -> dict:
    """One strategy's step on this rank, in fresh processes."""
    mesh = gbd.init_mesh()
    torch.manual_seed(0)
    x, y = _batch(cfg, local_batch)
    if which == "dense":
        return {
            "dense": _dense_peak(cfg, mesh, x, y),
            "dense_params": sum(p.numel() for p in GPT(cfg).parameters()),
        }
    return _gbfunc_peak(cfg, mesh, x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_fsdp.md")
    args = parser.parse_args()
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=4, seq=64)
    dense = spawn(worker, 2, "dense", cfg, args.local_batch, timeout=600.0)
    ours = spawn(worker, 2, "gbfunc", cfg, args.local_batch, timeout=600.0)
    results = [{**d, **g} for d, g in zip(dense, ours, strict=True)]
    mib = 2**20
    rows = [
        (
            str(rank),
            f"{r['dense'] / mib:.1f}",
            f"{r['gbfunc'] / mib:.1f}",
            f"{r['gbfunc'] / r['dense']:.2f}",
        )
        for rank, r in enumerate(results)
    ]
    r = results[0]
    text = (
        header_md("Peak memory per rank: FSDP2 of the dense GPT vs gbfunc with sharded free params")
        + f"- GPT: {cfg}; {r['dense_params']:,} parameters; 2 gloo ranks, {args.local_batch} "
        f"sequences per rank; AdamW\n"
        f"- gbfunc: `gb.plan(model, **{GENOME})` ({r['compression']:.1f}x), "
        f"{r['gbfunc_params']:,} trainable parameters; g-nets replicated, free parameters "
        "sharded by `gbd.ShardedFree` (per block and at the root)\n"
        "- peak bytes of CPU tensors alive during the second step (tensors alive at its "
        "start plus the peak of `torch.profiler`'s allocator count)\n\n"
        + markdown_table(
            [("rank", "r"), ("dense FSDP2 MiB", "r"), ("gbfunc MiB", "r"), ("gbfunc / dense", "r")],
            rows,
        )
    )
    print(text)
    write_results(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
