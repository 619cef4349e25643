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
events, `benchmarks/_meta.py`); with `--device cuda`, the peak of the CUDA caching
allocator's allocated bytes (`torch.cuda.reset_peak_memory_stats`,
`torch.cuda.max_memory_allocated`), and every timed span ends with `torch.cuda.synchronize()`.
A peer whose step does not compile with `fullgraph=True` is timed with `torch.compile` of its
forward + loss instead (graph breaks allowed; eager backward and AdamW), marked `*`, with the
reason under the table; a peer that is not installed, or fails even so, gets the reason
instead of numbers.

The peers are not gbfunc dependencies, and no extra installs them: both ship a top-level
`tests` package, which would become importable beside gbfunc in the project's venv. Install
them in a venv of their own (hyper-nn's metadata requires JAX; only its torch part is
imported, so it goes in without dependencies):

    python3 -m venv ~/.venvs/gbfunc-peers && . ~/.venvs/gbfunc-peers/bin/activate
    pip install torch==2.13.0 && pip install -e ".[demo]" hypnettorch==0.0.4
    pip install --no-deps hyper-nn
    python -m benchmarks.peers            # about 3 minutes on 2 CPU cores
    python -m benchmarks.peers --quick    # fewer rounds

On a GPU (`bash benchmarks/gpu_check.sh` runs it so, the peers installed from wheels that
`bash benchmarks/gpu_wheels.sh` downloads, on `PYTHONPATH` only, never into a venv):

    python -m benchmarks.peers --device cuda    # writes peers_gpu.md and peers_gpu.json
    python -m benchmarks.peers --dry-run        # one round of one step, one gbfunc genome
"""

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.func import functional_call

import gbfunc as gb
from benchmarks._meta import (
    RESULTS,
    benchmark_parser,
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


def plain(batch: tuple[Tensor, Tensor], device: torch.device) -> Contender:
    model = mlp().to(device)
    row = Contender("plain MLP", sum(p.numel() for p in model.parameters()))
    row.loss0 = cross_entropy(model(batch[0]), batch[1]).item()
    row.steps = dict(zip(MODES, dense_steps(model, batch, cross_entropy), strict=True))
    return row


def gbfunc_row(
    name: str, options: dict, batch: tuple[Tensor, Tensor], device: torch.device
) -> Contender:
    model = mlp().to(device)
    plan = gb.plan(model, **options)
    rep = gb.report(plan)
    row = Contender(f"{name} ({rep.generated_compression:.1f}x generated)")
    row.params = rep.gnet_params + rep.free_params
    with torch.no_grad():
        params = gb.apply(gb.init(plan, device=device), plan)
        row.loss0 = cross_entropy(functional_call(model, params, (batch[0],)), batch[1]).item()
    steps = gb_steps(model, plan, batch, cross_entropy, device=device)
    row.steps = dict(zip(MODES, steps, strict=True))
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


def peer_name(distribution: str, what: str) -> str:
    """`"NAME VERSION, what"`, the version as installed (without one when it is not)."""
    try:
        return f"{distribution} {metadata.version(distribution)}, {what}"
    except metadata.PackageNotFoundError:
        return f"{distribution}, {what}"


def peer_row(
    name: str,
    build: Callable[[], nn.Module],
    batch: tuple[Tensor, Tensor],
    device: torch.device,
    module: str,
) -> Contender:
    """A peer as one module `x -> logits` holding exactly its trainable parameters; `module`
    is the peer's top-level package (missing: "not installed")."""
    row = Contender(name)
    build_on = lambda: build().to(device)
    try:
        model = build_on()
    except Exception as error:  # not installed, or fails on this torch
        missing = isinstance(error, ModuleNotFoundError) and error.name == module
        row.failed = dict.fromkeys(MODES, ("not installed: " if missing else "") + _why(error))
        return row
    row.params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        row.loss0 = cross_entropy(model(batch[0]), batch[1]).item()
    row.steps = dict(zip(MODES, dense_steps(model, batch, cross_entropy), strict=True))
    row.fallback = lambda: compiled_loss_step(build_on(), batch)
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


def warm_up(rows: list[Contender], sync: Callable[[], None] = lambda: None) -> None:
    """Run every step once (compiling it; `sync` waits for the device, so that a kernel's
    error is the step's). A compiled step that raises is replaced by the row's fallback when
    it has one; a step that still raises is moved to `failed`."""
    for row in rows:
        for mode, step in list(row.steps.items()):
            try:
                step()
                sync()
            except Exception as error:
                del row.steps[mode]
                row.failed[mode] = _why(error)
                if mode == "compiled" and row.fallback is not None:
                    _try_fallback(row, mode, sync)


def _try_fallback(row: Contender, mode: str, sync: Callable[[], None]) -> None:
    try:
        step = row.fallback()
        step()
        sync()
    except Exception as error:
        row.failed[mode] += f" / with graph breaks: {_why(error)}"
        return
    row.steps[mode] = step
    row.notes[mode] = (
        f"fullgraph=True failed ({row.failed.pop(mode)}); timed instead: torch.compile of "
        "forward + loss with graph breaks allowed, eager backward and AdamW (marked *)"
    )


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes the CUDA caching allocator had allocated while `fn()` ran, above what was
    allocated before it: `fn` runs once to reach its steady state (the CPU measure does the
    same), then once measured between `reset_peak_memory_stats` and `max_memory_allocated`."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = benchmark_parser(
        __doc__,
        quick="fewer rounds",
        dry_run="one round of one step and only the first gbfunc genome: checks that it runs",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder to write into")
    parser.add_argument(
        "--name",
        help="the results' file name, without .md/.json (default: peers, on cuda peers_gpu)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    name = args.name or ("peers_gpu" if device.type == "cuda" else "peers")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = (torch.randn(128, 784).to(device), torch.randint(0, 10, (128,)).to(device))
    rows = [plain(batch, device)]
    genomes = list(GB_GENOMES.items())[: 1 if args.dry_run else None]
    for genome, options in genomes:
        torch.manual_seed(0)
        rows.append(gbfunc_row(genome, options, batch, device))
    torch.manual_seed(0)
    name_of = peer_name("hyper-nn", "TorchLinearHyperNetwork")
    rows.append(peer_row(name_of, hyper_nn, batch, device, "hypernn"))
    torch.manual_seed(0)
    name_of = peer_name("hypnettorch", "ChunkedHMLP")
    rows.append(peer_row(name_of, HypnettorchMLP, batch, device, "hypnettorch"))
    warm_up(rows, sync)
    measure = cuda_peak_bytes if device.type == "cuda" else peak_bytes
    peaks = {(r.name, m): measure(s) / 2**20 for r in rows for m, s in r.steps.items()}
    rounds, inner = (1, 1) if args.dry_run else (7, 5) if args.quick else (25, 10)
    steps = {(r.name, m): s for r in rows for m, s in r.steps.items()}
    times, _ = median_ms({f"{k[0]}|{k[1]}": s for k, s in steps.items()}, rounds, inner, sync)
    table = render(rows, times, peaks)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    title = "One training step: gbfunc vs hypernetwork peers (MLP 784-512-512-10, batch 128)"
    if device.type == "cuda":
        title = title.replace("One training step", "One training step on a GPU")
        gpu = torch.cuda.get_device_name()
        where = f"- device: {gpu}, CUDA {torch.version.cuda}; peak: CUDA allocator\n"
        extra = {"device": gpu}
    else:
        where, extra = "", {}
    write_results(
        args.out / f"{name}.md",
        header_md(title) + where + f"- rounds: {rounds} x {inner} steps\n\n" + table,
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
    write_json(args.out / f"{name}.json", records, rounds=rounds, inner=inner, **extra)


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
