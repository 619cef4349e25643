"""The main job's models, built from plain `torch.nn` so gbfunc's default rules apply."""

from typing import Any

from torch import Tensor, nn


class CharTransformer(nn.Module):
    """A small GPT-like decoder: token + position embeddings, pre-norm causal blocks, a head.

    Each block is an `nn.TransformerEncoderLayer` run with a causal mask (so it decodes), built
    separately so that layers do not start as copies of each other.

    Args:
        vocab: Number of token ids.
        context: Longest sequence the position table covers.
        width: Model width `D`.
        depth: Number of blocks.
        heads: Attention heads per block.
    """

    def __init__(self, vocab: int, context: int, width: int = 128, depth: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits `(B, T, vocab)` for token ids `(B, T)`."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos.weight[:t]  # (B, T, D)
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 single-channel images: two 3x3 conv stages, pooling, an MLP head.

    Args:
        channels: Channels of the two conv stages.
        hidden: Width of the hidden fully connected layer.
        classes: Number of classes.
    """

    def __init__(self, channels: tuple[int, int] = (32, 64), hidden: int = 128, classes: int = 10):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, c2, 4, 4)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c2 * 16, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Class logits `(B, classes)` for images `(B, 1, 8, 8)`."""
        return self.classifier(self.features(x))


def digits_mlp(hidden: int = 800) -> nn.Sequential:
    """The paper's MLP shape (Shuvaev et al. 2024: 784-800-10) for 8x8 digits: 64-hidden-10."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def paper_genome(
    hidden: int,
    first: str = "1.weight",
    grid: tuple[int, ...] = (8, 8),
    last: str = "3.*",
) -> dict[str, Any]:
    """`gb.plan` options of the paper's genome (defaults: for `digits_mlp`).

    One tanh g-net per weight and per bias, neurons labelled by the Gray code of their index,
    the inputs of `first` by the Gray codes of their position on `grid` (pixels: row,
    column), the outputs of `last` (classes) one-hot, every generated row centred.
    """
    return {
        "tile": "full",
        "encoding": "gray",
        "hidden": hidden,
        "activation": "tanh",
        "biases": True,
        "center": True,
        "overrides": {first: {"col_labels": grid}, last: {"row_labels": "onehot"}},
    }
