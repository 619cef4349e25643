"""gbfunc beside the installable hypernetwork libraries: one training step of the same task.

The task is one training step (generate, forward, cross-entropy, backward, AdamW) of the MLP
784-512-512-10 at batch 128, with every hypernetwork set to ~10x fewer trainable parameters
than the MLP has:

- plain: the MLP trained directly (`benchmarks/bench_step.py`'s dense step);
- gbfunc: the torchGB genome (32 hidden units) with `compression=10` (it picks 57x96 tiles),
  and row g-nets: 128x128 tiles with 8 hidden units whose g-nets emit a whole tile row per
  evaluation (`outputs=128`, 11.4x), and 256x256 tiles with 16 (`outputs=256`, 10.6x);
- hyper-nn: `hypernn.torch.TorchLinearHyperNetwork`, 90 embeddings of 8 into one linear layer
  emitting chunks of the flat parameter vector; the library's own init;
- hypnettorch: `hnets.ChunkedHMLP` over `mnets.MLP(no_weights=True)`, one hidden layer of 16,
  chunks of 4000, chunk embeddings of 8 as its only input, `apply_chunked_hyperfan_init`
  (Xavier variant: its fan-in default starts at a loss near 5).

Eager steps use `torch.optim.AdamW(foreach=True)`; compiled steps are the whole functional
step (`torch.func.grad_and_value` + `gb.optim.adamw_update`) under
`torch.compile(fullgraph=True)`, the same code for every contender. Times are medians over
interleaved rounds, as ratios to the plain model in the same mode. Peak memory is the peak of
torch's CPU allocator during one step above what was held before it (`torch.profiler` memory
events, `benchmarks/_meta.py`). A peer whose step does not compile with `fullgraph=True` is
timed with `torch.compile` of its forward + loss instead (graph breaks allowed; eager backward
and AdamW), marked `*`, with the reason under the table; a peer that is not installed, or
fails even so, gets the reason instead of numbers.

The peers are not gbfunc dependencies, and no extra installs them: both ship a top-level
`tests` package, which would become importable beside gbfunc in the project's venv. Install
them in a venv of their own (hyper-nn's metadata requires JAX; only its torch part is
imported, so it goes in without dependencies):

    python3 -m venv ~/.venvs/gbfunc-peers && . ~/.venvs/gbfunc-peers/bin/activate
    pip install torch==2.13.0 && pip install -e ".[demo]" hypnettorch==0.0.4
    pip install --no-deps hyper-nn
    python -m benchmarks.peers            # about 3 minutes on 2 CPU cores
    python -m benchmarks.peers --quick    # fewer rounds
"""

import argparse
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import functional_call

import gbfunc as gb
from benchmarks._meta import (
    RESULTS,
    header_md,
    markdown_table,
    peak_bytes,
    write_json,
    write_results,
)
from benchmarks.bench_step import (
    Step,
    cross_entropy,
    dense_steps,
    gb_steps,
    median_ms,
    mlp,
)

MODES = ("eager", "compiled")
GB_GENOMES = {
    "gbfunc, torchGB genome, compression=10": {"compression": 10, "compression_of": "generated"},
    "gbfunc, row g-nets, hidden 8, tile 128": {"tile": (128, 128), "hidden": 8, "outputs": 128},
    "gbfunc, row g-nets, hidden 16, tile 256": {"tile": (256, 256), "hidden": 16, "outputs": 256},
}


@dataclass
class Contender:
    """One row: its trainable parameters, step-0 loss, steps per mode, or why it has none."""

    name: str
    params: int = 0
    loss0: float = math.nan
    steps: dict[str, Step] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    fallback: Callable[[], Step] | None = None  # a compiled step allowing graph breaks


def plain(batch: tuple[Tensor, Tensor]) -> Contender:
    model = mlp()
    row = Contender("plain MLP", sum(p.numel() for p in model.parameters()))
    row.loss0 = cross_entropy(model(batch[0]), batch[1]).item()
    row.steps = dict(zip(MODES, dense_steps(model, batch, cross_entropy), strict=True))
    return row


def gbfunc_row(name: str, options: dict, batch: tuple[Tensor, Tensor]) -> Contender:
    model = mlp()
    plan = gb.plan(model, **options)
    rep = gb.report(plan)
    row = Contender(f"{name} ({rep.generated_compression:.1f}x generated)")
    row.params = rep.gnet_params + rep.free_params
    with torch.no_grad():
        params = gb.apply(gb.init(plan), plan)
        row.loss0 = cross_entropy(functional_call(model, params, (batch[0],)), batch[1]).item()
    row.steps = dict(zip(MODES, gb_steps(model, plan, batch, cross_entropy), strict=True))
    return row


class HypnettorchMLP(nn.Module):
    """hypnettorch's chunked hypernetwork and the weightless MLP it feeds, as one module."""

    def __init__(self) -> None:
        super().__init__()
        from hypnettorch.hnets import ChunkedHMLP
        from hypnettorch.mnets import MLP

        self.mnet = MLP(784, 10, hidden_layers=(512, 512), no_weights=True, verbose=False)
        self.hnet = ChunkedHMLP(
            self.mnet.param_shapes,
            chunk_size=4000,
            chunk_emb_size=8,
            layers=(16,),
            cond_in_size=0,
            cond_chunk_embs=True,
            verbose=False,
        )
        self.hnet.apply_chunked_hyperfan_init(mnet=self.mnet, use_xavier=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.mnet(x, weights=self.hnet(cond_id=0))


def hyper_nn() -> nn.Module:
    from hypernn.torch import TorchLinearHyperNetwork

    return TorchLinearHyperNetwork(mlp(), embedding_dim=8, num_embeddings=90)


def peer_row(name: str, build: Callable[[], nn.Module], batch: tuple[Tensor, Tensor]) -> Contender:
    """A peer as one module `x -> logits` holding exactly its trainable parameters."""
    row = Contender(name)
    try:
        model = build()
    except Exception as error:  # not installed, or fails on this torch
        row.failed = dict.fromkeys(MODES, _why(error))
        return row
    row.params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        row.loss0 = cross_entropy(model(batch[0]), batch[1]).item()
    row.steps = dict(zip(MODES, dense_steps(model, batch, cross_entropy), strict=True))
    row.fallback = lambda: compiled_loss_step(build(), batch)
    return row


def compiled_loss_step(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Step:
    """`torch.compile` of forward + loss with graph breaks allowed; eager backward and AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    loss = torch.compile(lambda x, y: cross_entropy(model(x), y))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(*batch).backward()
        opt.step()

    return step


def _why(error: BaseException) -> str:
    """The exception's first line and, from dynamo, its explanation, cut to a table note."""
    lines = traceback.format_exception_only(error)[-1].strip().splitlines()
    text = "; ".join(
        [lines[0], *(s.strip() for s in lines if s.strip().startswith("Explanation:"))]
    )
    return text if len(text) < 300 else text[:297] + "..."


def warm_up(rows: list[Contender]) -> None:
    """Run every step once (compiling it). A compiled step that raises is replaced by the
    row's fallback when it has one; a step that still raises is moved to `failed`."""
    for row in rows:
        for mode, step in list(row.steps.items()):
            try:
                step()
            except Exception as error:
                del row.steps[mode]
                row.failed[mode] = _why(error)
                if mode == "compiled" and row.fallback is not None:
                    _try_fallback(row, mode)


def _try_fallback(row: Contender, mode: str) -> None:
    try:
        step = row.fallback()
        step()
    except Exception as error:
        row.failed[mode] += f" / with graph breaks: {_why(error)}"
        return
    row.steps[mode] = step
    row.notes[mode] = (
        f"fullgraph=True failed ({row.failed.pop(mode)}); timed instead: torch.compile of "
        "forward + loss with graph breaks allowed, eager backward and AdamW (marked *)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = (torch.randn(128, 784), torch.randint(0, 10, (128,)))
    rows = [plain(batch)]
    for name, options in GB_GENOMES.items():
        torch.manual_seed(0)
        rows.append(gbfunc_row(name, options, batch))
    torch.manual_seed(0)
    rows.append(peer_row("hyper-nn 0.2.2, TorchLinearHyperNetwork", hyper_nn, batch))
    torch.manual_seed(0)
    rows.append(peer_row("hypnettorch 0.0.4, ChunkedHMLP", HypnettorchMLP, batch))
    warm_up(rows)
    peaks = {(r.name, m): peak_bytes(s) / 2**20 for r in rows for m, s in r.steps.items()}
    rounds, inner = (7, 5) if args.quick else (25, 10)
    steps = {(r.name, m): s for r in rows for m, s in r.steps.items()}
    times, _ = median_ms({f"{k[0]}|{k[1]}": s for k, s in steps.items()}, rounds, inner)
    table = render(rows, times, peaks)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    title = "One training step: gbfunc vs hypernetwork peers (MLP 784-512-512-10, batch 128)"
    write_results(
        args.out / "peers.md", header_md(title) + f"- rounds: {rounds} x {inner} steps\n\n" + table
    )
    records = [
        {
            "contender": r.name,
            "trainable_params": r.params,
            "loss0": r.loss0,
            **{f"{m}_ms": times.get(f"{r.name}|{m}") for m in MODES},
            **{f"{m}_peak_mib": peaks.get((r.name, m)) for m in MODES},
            "failed": r.failed,
            "notes": r.notes,
        }
        for r in rows
    ]
    write_json(args.out / "peers.json", records, rounds=rounds, inner=inner)


def render(
    rows: list[Contender], times: dict[str, float], peaks: dict[tuple[str, str], float]
) -> str:
    """The markdown table: params, step-0 loss, and per mode ms, x plain, peak MiB."""
    dense = rows[0].params
    base = {m: times.get(f"{rows[0].name}|{m}") for m in MODES}
    columns = [("contender", "l")] + [
        (title, "r")
        for title in (
            "trainable params",
            "x fewer",
            "step-0 loss",
            *(title for m in MODES for title in (f"{m} ms", "x plain", f"{m} peak MiB")),
        )
    ]
    table, notes = [], []
    for r in rows:
        cells = [
            r.name,
            f"{r.params:,}" if r.params else "-",
            f"{dense / r.params:.1f}x" if r.params else "-",
            "-" if math.isnan(r.loss0) else f"{r.loss0:.3f}",
        ]
        for m in MODES:
            ms = times.get(f"{r.name}|{m}")
            if ms is None:
                cells += ["failed", "-", "-"]
                notes.append(f"- {r.name}, {m}: {r.failed[m]}")
                continue
            mark = "*" if m in r.notes else ""
            cells += [f"{ms:.2f}{mark}", f"{ms / base[m]:.2f}{mark}", f"{peaks[(r.name, m)]:.1f}"]
            if mark:
                notes.append(f"- {mark} {r.name}, {m}: {r.notes[m]}")
        table.append(cells)
    footer = f"step-0 loss: ln(10) = {math.log(10):.3f} for a uniform prediction.\n"
    return (
        markdown_table(columns, table) + footer + ("\n" + "\n".join(notes) + "\n" if notes else "")
    )


if __name__ == "__main__":
    main()
