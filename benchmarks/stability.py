"""Why the character transformer's hashed genome is seed-sensitive at the default rates.

Trains only the gbfunc arm of `lr_rule`'s transformer runs (the main job's character
transformer, its hashed genome at ~20x, `gb.optim.param_groups`' default rates, the free
tensors at the dense rate; `equal_params`' protocol: Adam, warm-up then cosine decay), on the
main job's corpus (pydoc help topics, `main`), on `lr_rule`'s held-out code corpus
(`held-out`) and on `transfer`'s corpora (`email`, `package-docs`), and logs per step: the
loss; per leaf kind (the hashed tables, each g-net layer, the free norms and biases) the
gradient norm and Adam's update norm relative to the leaf's norm; every `--every` steps the
generated weights' RMS per layer and their update relative to it. Loss spikes are flagged (a
step's loss 10% above the median of the 20 before it, after the warm-up). A variant
(`VARIANTS`) changes one thing: clipping, warm-up, Adam's epsilon, the tables' initial scale,
a leaf kind's rate, or which seed draws what (the batches' order, the model's own start, the
g-nets, the tables), to find where the seeds' spread comes from.

    python -m benchmarks.stability --steps 300 --variants default clip1
    python -m benchmarks.stability --steps 800 --variants default    # about 3 min a run
    python -m benchmarks.stability --rows benchmarks/results/stability.json   # report only

Runs accumulate in `--rows` (JSON, one row per corpus, variant, steps and seed; the per-step
logs go to `--logs`); the report (`--out`) gives each configuration's seeds, mean, spread
(max - min) and standard error, and the per-kind summaries.
"""

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gbfunc as gb
from benchmarks import equal_params as ep, lr_rule, transfer
from benchmarks._meta import RESULTS, recorded
from gbfunc._plan import TILE_LEAVES

CORPORA = {"main": "charlm", "held-out": "charlm held-out"}  # lr_rule's task names
TRANSFER_CORPORA = ("email", "package-docs")  # `transfer`'s, chosen after the default was set
SPIKE, SPIKE_WINDOW = 1.10, 20  # a loss 10% above the median of the 20 steps before

# A variant: keyword arguments of `run` (see there).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "clip1": {"clip": 1.0},
    "clip0.25": {"clip": 0.25},
    "warmup200": {"warmup": 200},
    "eps1e-6": {"eps": 1e-6},
    "tables x0.3 rate": {"rates": {"tile_hash": 0.3}},
    "tables x0.1 rate": {"rates": {"tile_hash": 0.1}},
    "g-nets x0.3 rate": {"rates": {"gnet": 0.3}},
    "free x0.3 rate": {"rates": {"free": 0.3}},
    "tables init x0.3": {"table_init": 0.3},
    # every leaf row (tables' tiles, g-nets) of the embeddings at a factor of its rate
    "embeddings x0.1 rate": {"param_rates": {"tok.weight": 0.1, "pos.weight": 0.1}},
    "embeddings x0.3 rate": {"param_rates": {"tok.weight": 0.3, "pos.weight": 0.3}},
    "embeddings x0.03 rate": {"param_rates": {"tok.weight": 1 / 30, "pos.weight": 1 / 30}},
    "embeddings free": {"plan": {"embeddings": False}},
    # the model's embeddings drawn at std 1/sqrt(dim), where nn.Embedding draws N(0, 1): the
    # generated tables then start at their step unit (`step_scale`), not sqrt(dim) above it
    "warmup200, embeddings at the unit": {"warmup": 200, "embed_std": 1.0},
    # equal_params' tiled genome (no tables, one g-net per tile) under the library's warm-up
    "tiled genome, warmup200": {"warmup": 200, "plan": {"share": False, "hashed": 0}},
    # where the seeds' spread comes from: the start (genome, model) or the batches' order
    "warmup200, batches of seed 0": {"warmup": 200, "data_seed": 0},
    "warmup200, start of seed 0": {"warmup": 200, "model_seed": 0, "genome_seed": 0},
    "warmup200, batches and model of seed 0": {"warmup": 200, "data_seed": 0, "model_seed": 0},
    "warmup200, all but the g-nets of seed 0": {
        "warmup": 200,
        "data_seed": 0,
        "model_seed": 0,
        "table_seed": 0,
    },
}


def rows_of(plan: gb.Plan, names: dict[str, float]) -> dict[str, dict[str, Tensor]]:
    """`{stack key: {leaf: factor per row}}`: the factor of `names` (parameter name: factor)
    for the rows of each stack leaf that generate only that parameter (a tile's table and
    embedding; its g-net where one g-net generates nothing else), 1 elsewhere."""
    out: dict[str, dict[str, Tensor]] = {}
    for index, stack in enumerate(plan.stacks):
        owner: list[str | None] = [None] * stack.num_tiles
        for p in plan.generated:
            if p.stack_index == index:
                for b in p.blocks:
                    for t in range(b.first_tile, b.first_tile + b.grid[0] * b.grid[1]):
                        owner[t] = p.name
        tile = torch.tensor([names.get(o, 1.0) for o in owner], dtype=torch.float64)
        gnet = torch.ones(len(stack.tiles_per_gnet), dtype=torch.float64)
        for g in range(len(gnet)):
            mine = {owner[t] for t, o in enumerate(stack.gnet_of_tile) if o == g}
            if len(mine) == 1:
                gnet[g] = names.get(mine.pop(), 1.0)
        out[stack.key] = {"tile": tile, "gnet": gnet}
    return out


def _kind(name: str) -> str:
    """A free tensor's kind: `free norm` (LayerNorm), `free bias` or `free weight` (e.g. the
    embeddings, left free)."""
    if ".norm" in name or name.startswith("norm"):
        return "free norm"
    return "free bias" if name.endswith("bias") else "free weight"


def kinds(tree: dict) -> dict[str, list[Tensor]]:
    """`{kind: [leaf, ...]}`: the g-net leaves by name (`tile_hash`: the tables), the free
    tensors by `_kind`."""
    out: dict[str, list[Tensor]] = {}
    for leaves in tree["stacks"].values():
        for name, t in leaves.items():
            out.setdefault(name, []).append(t)
    for name, t in tree["free"].items():
        out.setdefault(_kind(name), []).append(t)
    return out


def _norm(ts: list[Tensor]) -> float:
    return float(torch.sqrt(sum(t.detach().double().square().sum() for t in ts)))


def _rms(t: Tensor) -> float:
    return float(t.detach().double().square().mean().sqrt())


class Monitor:
    """The per-step logs of one run (`hook` is `equal_params.train`'s)."""

    def __init__(
        self, arm: ep.Arm, gparams: dict, generated: list[str], every: int, clip: float | None
    ):
        self.arm, self.generated, self.every, self.clip = arm, generated, every, clip
        self.kinds = kinds(gparams)  # the same leaves as `arm.tree`'s
        self.log: dict[str, Any] = {
            "loss": [],
            "grad": {k: [] for k in self.kinds},
            "update": {k: [] for k in self.kinds},
            "weights_step": [],
            "weights_rms": {n: [] for n in generated},
            "weights_update": {n: [] for n in generated},
        }

    def hook(self, step: int, loss: Tensor, optimizer: torch.optim.Optimizer) -> Callable:
        self.log["loss"].append(loss.item())
        for k, ts in self.kinds.items():
            self.log["grad"][k].append(_norm([t.grad for t in ts if t.grad is not None]))
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]], self.clip
            )
        before = {k: [t.detach().clone() for t in ts] for k, ts in self.kinds.items()}
        weights = self._weights() if step % self.every == 0 else None

        def after() -> None:
            for k, ts in self.kinds.items():
                delta = _norm([t.detach() - b for t, b in zip(ts, before[k], strict=True)])
                self.log["update"][k].append(delta / max(_norm(before[k]), 1e-30))
            if weights is not None:
                new = self._weights()
                self.log["weights_step"].append(step)
                for n in self.generated:
                    self.log["weights_rms"][n].append(_rms(weights[n]))
                    moved = _rms(new[n] - weights[n]) / _rms(weights[n])
                    self.log["weights_update"][n].append(moved)

        return after

    def _weights(self) -> dict[str, Tensor]:
        # With autograd on: under no_grad `gb.apply` compiles its inference path once (12 s).
        params = self.arm.to_params(self.arm.tree)
        return {n: params[n].detach() for n in self.generated}


def spikes(losses: list[float], after: int) -> list[tuple[int, float]]:
    """`(step, loss / median of the SPIKE_WINDOW before)` of every step past `after` whose
    loss exceeds that median by `SPIKE`."""
    out = []
    for t in range(max(after, SPIKE_WINDOW), len(losses)):
        ratio = losses[t] / statistics.median(losses[t - SPIKE_WINDOW : t])
        if ratio > SPIKE:
            out.append((t, round(ratio, 3)))
    return out


def run(
    corpus: str,
    seed: int,
    steps: int,
    *,
    every: int = 10,
    clip: float | None = None,
    warmup: int | None = None,
    eps: float | None = None,
    rates: dict[str, float] | None = None,
    table_init: float | None = None,
    param_rates: dict[str, float] | None = None,
    plan: dict[str, Any] | None = None,
    embed_std: float | None = None,
    model_seed: int | None = None,
    genome_seed: int | None = None,
    table_seed: int | None = None,
    data_seed: int | None = None,
) -> tuple[dict, dict]:
    """`(row, log)` of one run of the gbfunc arm on `corpus` (`CORPORA`, `TRANSFER_CORPORA`).

    `clip`: the gradients' total norm clipped to it; `warmup`: warm-up steps (default
    `equal_params`': a tenth of the steps); `eps`: Adam's; `rates`: factors of the default
    rates by leaf kind (a g-net leaf's name, `gnet` for every g-net leaf but the tables,
    `free` for the free tensors); `table_init`: factor of the tables' initial values;
    `param_rates`: factors of the rates of the leaf rows that generate one parameter (by
    name; Adam's step scaled after the update, which is a per-row rate); `plan`: `gb.plan`
    options over the genome's; `embed_std`: the model's embeddings redrawn at this std over
    `sqrt(dim)` before planning (gbfunc starts a generated weight at its tensor's std);
    `model_seed`, `genome_seed`, `table_seed`, `data_seed`: instead of `seed`, the seed of
    the model's own start (its free tensors), of `gb.init` (g-nets and tables), of the
    tables alone, or of the batches' order.
    """
    torch.set_num_threads(1)
    if corpus in CORPORA:
        task, dense_lr = lr_rule.TASKS[CORPORA[corpus]], lr_rule.DENSE_LR[CORPORA[corpus]]
    else:
        task, dense_lr = transfer.text_task(corpus), transfer.TASKS[corpus][3]
    if embed_std is not None:
        task = dataclasses.replace(task, build=_embeddings_at(task.build, embed_std))
    data = task.data()
    options = {**ep.TASKS["charlm"].genomes[lr_rule.MAIN["charlm"]][2], **(plan or {})}
    arm, plan_ = ep.gbfunc_arm(task, "stability", options, _or(model_seed, seed), data)
    if _or(genome_seed, seed) != _or(model_seed, seed) or table_seed is not None:
        arm = dataclasses.replace(arm, tree=_genome_of(plan_, _or(genome_seed, seed), table_seed))
    if table_init is not None:
        with torch.no_grad():
            for leaves in arm.tree["stacks"].values():
                if gb.optim.TABLE_LEAF in leaves:
                    leaves[gb.optim.TABLE_LEAF].mul_(table_init)
    factors = rates or {}
    by_id = lr_rule.rates(arm.tree, plan_, "default")
    for leaves in arm.tree["stacks"].values():
        for name, t in leaves.items():
            gnet = "gnet" if name != gb.optim.TABLE_LEAF else name
            by_id[id(t)] *= factors.get(name, factors.get(gnet, 1.0))
    free_lr = dense_lr * factors.get("free", 1.0)
    trained = lr_rule.at_rates(arm, plan_, by_id, free_lr)
    generated = sorted({e.name for e in gb.report(plan_).rows if e.kind == "generated"})
    monitor = Monitor(trained, arm.tree, generated, every, clip)

    per_row = rows_of(plan_, param_rates) if param_rates else None

    def hook(step: int, loss: Tensor, optimizer: torch.optim.Optimizer) -> Callable:
        if eps is not None:
            for g in optimizer.param_groups:
                g["eps"] = eps
        after = monitor.hook(step, loss, optimizer)
        if per_row is None:
            return after
        stacks = arm.tree["stacks"]
        before = {k: {n: t.detach().clone() for n, t in v.items()} for k, v in stacks.items()}

        def scaled() -> None:
            with torch.no_grad():
                for key, leaves in stacks.items():
                    for name, t in leaves.items():
                        f = per_row[key]["tile" if name in TILE_LEAVES else "gnet"]
                        f = f.to(t.dtype).reshape(-1, *[1] * (t.dim() - 1))
                        t.copy_(before[key][name] + f * (t - before[key][name]))
            after()

        return scaled

    start = time.perf_counter()
    batches = _or(data_seed, seed)
    loss, _ = ep.train(trained, 1.0, data, steps, task.batch, batches, warmup=warmup, hook=hook)
    seconds = time.perf_counter() - start
    first = max(1, min(100, steps // 10)) if warmup is None else warmup
    log = monitor.log
    row = {
        "corpus": corpus,
        "steps": steps,
        "seed": seed,
        "val_loss": loss,
        "seconds": round(seconds, 1),
        "spikes": spikes(log["loss"], first),
        # the training loss's mean over the 20 steps before each 100th step
        "loss at": {
            t: statistics.mean(log["loss"][t - 20 : t]) for t in range(100, steps + 1, 100)
        },
        "summary": summary(log, first),
        "rms at": rms_at(log),
        "elements": {k: sum(t.numel() for t in ts) for k, ts in monitor.kinds.items()},
    }
    return row, log


def _genome_of(plan: gb.Plan, seed: int, table_seed: int | None) -> dict:
    """`gb.init(plan, seed=seed)`, its hashed tables drawn with `table_seed` where given."""
    gparams = gb.init(plan, seed=seed)
    if table_seed is not None:
        tables = gb.init(plan, seed=table_seed)["stacks"]
        for key, leaves in gparams["stacks"].items():
            if gb.optim.TABLE_LEAF in leaves:
                leaves[gb.optim.TABLE_LEAF] = tables[key][gb.optim.TABLE_LEAF]
    return gparams


def _or(chosen: int | None, seed: int) -> int:
    return seed if chosen is None else chosen


def _embeddings_at(
    build: Callable[[int | None], nn.Module], std: float
) -> Callable[[int | None], nn.Module]:
    """`build` with every `nn.Embedding` of the model redrawn from N(0, (std / sqrt(dim))^2)."""

    def built(width: int | None) -> nn.Module:
        model = build(width)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, std / math.sqrt(module.embedding_dim))
        return model

    return built


def rms_at(log: dict, names: tuple[str, ...] = ("tok.weight", "pos.weight")) -> dict:
    """`{name: {step: RMS}}` of the generated layers `names` at every 100th step."""
    steps = log["weights_step"]
    return {
        n: {t: r for t, r in zip(steps, log["weights_rms"][n], strict=True) if t % 100 == 0}
        for n in names
        if n in log["weights_rms"]
    }


def summary(log: dict, warmup: int) -> dict:
    """Per kind the median and max gradient norm and relative update (after the warm-up's
    first half), per generated layer its RMS at the start and the end and its largest
    relative update."""
    lo = warmup // 2
    total = [
        sum(g[t] ** 2 for g in log["grad"].values()) ** 0.5 for t in range(lo, len(log["loss"]))
    ]
    out: dict[str, Any] = {
        "all leaves": {"grad med": statistics.median(total), "grad max": max(total)}
    }
    for k in log["grad"]:
        g, u = log["grad"][k][lo:], log["update"][k][lo:]
        out[k] = {
            "grad med": statistics.median(g),
            "grad max": max(g),
            "update med": statistics.median(u),
            "update max": max(u),
        }
    for n, rms in log["weights_rms"].items():
        out[n] = {
            "rms start": rms[0],
            "rms end": rms[-1],
            "update med": statistics.median(log["weights_update"][n]),
            "update max": max(log["weights_update"][n]),
        }
    return out


def _key(row: dict) -> tuple:
    return row["variant"], row["steps"], row["corpus"]


def report(rows: list[dict]) -> None:
    """Each configuration's per-seed validation losses, mean, spread and standard error; the
    seconds per run; the spikes; then per-kind medians of the relative update."""
    print(
        "Variants without a tag ran on the library before the fan-in step scale (commit "
        "f0e45f5: `Generated.scale` the model's own std, embeddings' included); ', fan-in step "
        "scale': with it (`gbfunc._rules.step_scale`: the scale capped at 1/sqrt(fan_in), the "
        "raw tile starting at std `Generated.start`). Validation loss in nats after the run's "
        f"steps; spikes: steps whose loss exceeds the median of the {SPIKE_WINDOW} before by "
        f"{SPIKE - 1:.0%}, after the warm-up.\n"
    )
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    print(
        "| variant | steps | corpus | seeds | per seed (nats) | mean | spread (max-min) | s.e. "
        "| seconds per run | spikes per run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(groups, key=lambda k: (k[1], k[2], k[0] != "default", k[0])):
        runs = sorted(groups[key], key=lambda r: r["seed"])
        v = [r["val_loss"] for r in runs]
        se = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan")
        seconds = ", ".join(f"{r['seconds']:.0f}" for r in runs)
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {', '.join(str(r['seed']) for r in runs)} | "
            f"{', '.join(f'{x:.4f}' for x in v)} | {statistics.mean(v):.4f} | "
            f"{max(v) - min(v):.4f} | {se:.4f} | "
            f"{seconds} | "
            f"{', '.join(str(len(r['spikes'])) for r in runs)} |"
        )
    print(
        "\nTraining loss (mean of the 20 steps before) at every 100th step, per seed, and the "
        "generated embeddings' RMS at step 0, 100, 200, ...:\n"
    )
    for key in sorted(groups, key=lambda k: (k[1], k[2], k[0] != "default", k[0])):
        for r in sorted(groups[key], key=lambda r: r["seed"]):
            at = " ".join(f"{t}:{v:.2f}" for t, v in r["loss at"].items())
            rms = "; ".join(
                f"{n} " + " ".join(f"{v:.2f}" for v in by_step.values())
                for n, by_step in r["rms at"].items()
            )
            print(f"- {' / '.join(map(str, key))}, seed {r['seed']}: {at} (RMS: {rms})")
    print(
        "\nMedian (max) over steps past half the warm-up of Adam's update norm relative to "
        "the leaf's norm, per leaf kind, seed 0 (the generated layers: the RMS of the update "
        "of the generated weights relative to theirs, every few steps):\n"
    )
    for key in sorted(groups, key=lambda k: (k[1], k[2], k[0] != "default", k[0])):
        run0 = min(groups[key], key=lambda r: r["seed"])
        parts = [
            f"{k} {s['update med']:.2g} ({s['update max']:.2g})"
            for k, s in run0["summary"].items()
            if "update med" in s
        ]
        print(f"- {' / '.join(map(str, key))}, seed {run0['seed']}: " + "; ".join(parts))
    print(
        "\nClipping and Adam's epsilon: the gradient norm of all leaves, median and max over "
        "steps past half the warm-up (clipping acts only above a threshold, on outliers), and "
        "the smallest per-element gradient RMS of any leaf kind (median over those steps; "
        "Adam's epsilon, 1e-8, matters only near it):\n"
    )
    for key in sorted(groups, key=lambda k: (k[1], k[2], k[0] != "default", k[0])):
        cells = []
        for r in sorted(groups[key], key=lambda r: r["seed"]):
            s = r["summary"]
            smallest = min(
                s[k]["grad med"] / n**0.5 for k, n in r["elements"].items() if n and k in s
            )
            cells.append(
                f"seed {r['seed']}: {s['all leaves']['grad med']:.2g}, "
                f"{s['all leaves']['grad max']:.2g}, {smallest:.1e}"
            )
        print(f"- {' / '.join(map(str, key))}: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpora", nargs="+", default=list(CORPORA), choices=[*CORPORA, *TRANSFER_CORPORA]
    )
    parser.add_argument("--variants", nargs="+", default=["default"], choices=VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rows", type=Path, default=RESULTS / "stability.json")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/stability_logs"))
    parser.add_argument("--out", type=Path, default=RESULTS / "stability.md")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--tag", default="", help="appended to the variant's name in the rows (e.g. the code)"
    )
    args = parser.parse_args(argv)
    rows = json.loads(args.rows.read_text()) if args.rows.exists() else []
    if not args.report_only:
        args.logs.mkdir(parents=True, exist_ok=True)
        for variant in args.variants:
            for corpus in args.corpora:
                for seed in args.seeds:
                    row, log = run(corpus, seed, args.steps, every=args.every, **VARIANTS[variant])
                    row = {"variant": variant + args.tag, **row}
                    print(
                        f"{row['variant']} {corpus} seed {seed} {args.steps} steps: "
                        f"{row['val_loss']:.4f} nats, {row['seconds']:.0f} s, "
                        f"{len(row['spikes'])} spikes",
                        flush=True,
                    )
                    name = f"{row['variant']}_{corpus}_{args.steps}_{seed}.json".replace(" ", "_")
                    (args.logs / name).write_text(json.dumps(log))
                    same = (row["variant"], args.steps, corpus, seed)
                    rows = [r for r in rows if (*_key(r), r["seed"]) != same] + [row]
                    args.rows.write_text(json.dumps(rows, indent=1) + "\n")
    with recorded(args.out, "Stability of the transformer's hashed genome at the default rates"):
        report(rows)


if __name__ == "__main__":
    main()
