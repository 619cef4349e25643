"""A small GPT for the distributed examples, tests and benchmarks: TP-ready, stage-splittable.

Attention keeps Q, K, V and the output projection as separate `nn.Linear`s and infers the
number of heads from its input, so that column-parallel Q/K/V give each tensor-parallel
rank whole heads. A stage (`GPT(cfg, stage=(i, n))`) holds a contiguous run of blocks and
names its parameters exactly as the whole model does; the token embedding is tied to the
output head (scaled by `1/sqrt(dim)`), so the first and last stages both hold it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT; `GPTConfig(50304, 768, 12, 12, 1024)` is GPT-2 small."""

    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 32


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # (B, nh, T, hs); nh is the local number of heads under tensor parallelism
        q, k, v = (
            f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids `(B, T)` to logits `(B, T, vocab)`, or one pipeline stage of that.

    Args:
        cfg: Sizes.
        stage: `(index, count)`: build only stage `index` of `count` (blocks split evenly);
            the first stage takes token ids, the others hidden states `(B, T, dim)`; the
            last returns logits, the others hidden states.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(vocab=50304, dim=768, layers=12, heads=12, seq=1024))
    """

    def __init__(self, cfg: GPTConfig, *, stage: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        index, count = stage
        if not 0 <= index < count <= cfg.layers:
            raise ValueError(
                f"GPT: stage must be (index, count) with 0 <= index < count <= layers, got {stage}."
            )
        self.first, self.last = index == 0, index == count - 1
        if self.first or self.last:
            self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        if self.first:
            self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        lo, hi = index * cfg.layers // count, (index + 1) * cfg.layers // count
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(lo, hi)})
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            # Head tied to the token embedding, scaled so unit-variance embeddings (the default
            # of nn.Embedding and gb.init) give unit-scale logits.
            x = F.linear(self.ln_f(x), self.wte.weight) * x.shape[-1] ** -0.5
        return x


# The linear layers of a block that tensor parallelism splits by output and by input.
COLUMN_PARALLEL = ("attn.q", "attn.k", "attn.v", "mlp.fc1")
ROW_PARALLEL = ("attn.o", "mlp.fc2")


def tp_plan(model: GPT) -> dict[str, ParallelStyle]:
    """`parallelize_module` plan: column-parallel Q/K/V and fc1, row-parallel output and fc2."""
    plan: dict[str, ParallelStyle] = {}
    for i in model.blocks:
        for name in COLUMN_PARALLEL:
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ROW_PARALLEL:
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def sp_plan(model: GPT) -> dict[str, ParallelStyle]:
    """`tp_plan` with Megatron-style sequence parallelism (Korthikanti et al. 2022).

    Between the tensor-parallel regions the residual stream and the block LayerNorms are
    sharded along the sequence (`SequenceParallel`); it is all-gathered before attention and
    the MLP and reduce-scattered after their row-parallel outputs. The first block slices its
    (replicated) input; the final LayerNorm gathers the sequence back for the tied head.
    """
    plan = tp_plan(model)
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    for i in model.blocks:
        block = f"blocks.{i}"
        plan[f"{block}.ln1"] = SequenceParallel()
        plan[f"{block}.ln2"] = SequenceParallel()
        plan[f"{block}.attn"] = gather
        plan[f"{block}.mlp"] = gather
        for name in ROW_PARALLEL:  # reduce-scatter along the sequence instead of all-reduce
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    if model.first:
        first = f"blocks.{next(iter(model.blocks))}"
        plan[first] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if model.last:
        plan["ln_f"] = gather
    return plan


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def counting_data(cfg: GPTConfig, samples: int, seed: int = 0) -> TensorDataset:
    """Sequences that count modulo `vocab` with a per-sequence stride: `(inputs, next tokens)`.

    The stride is read off the first two tokens, so a small model learns it quickly.
    """
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab, (samples, 1), generator=gen)
    stride = torch.randint(1, 8, (samples, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])
