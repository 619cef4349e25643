"""Real data that ships with Python or a package, so nothing is downloaded at run time.

- `pydoc_text`: the text of Python's own help topics (`pydoc_data.topics`, ~465k characters).
- `CharCorpus`: that text as character ids, split into train and validation.
- `digits_split`: scikit-learn's handwritten digits (1797 8x8 images, 10 classes).
"""

from dataclasses import dataclass

import torch
from torch import Tensor


def pydoc_text() -> str:
    """The help topics of the running Python, joined in a fixed (sorted-key) order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: vocabulary and the train/validation id sequences.

    Attributes:
        chars: The vocabulary; id `i` is `chars[i]`.
        train: Ids of the first part of the text, `(N_train,)` int64.
        val: Ids of the rest, `(N_val,)` int64.
    """

    chars: str
    train: Tensor
    val: Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> "CharCorpus":
        """Build the vocabulary from all of `text`; the last `val_fraction` is validation."""
        chars = "".join(sorted(set(text)))
        index = {ch: i for i, ch in enumerate(chars)}
        ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
        cut = int(len(ids) * (1 - val_fraction))
        return cls(chars, ids[:cut], ids[cut:])

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def unigram_entropy(self) -> float:
        """Entropy (nats/char) of the train set's character frequencies: a model that ignores
        context cannot beat this on text with the same statistics."""
        p = torch.bincount(self.train, minlength=self.vocab_size).double()
        p = p[p > 0] / p.sum()
        return float(-(p * p.log()).sum())


def char_batch(
    ids: Tensor, batch: int, context: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Random windows of `ids`: inputs `(B, T)` and next-character targets `(B, T)`."""
    start = torch.randint(len(ids) - context - 1, (batch,), generator=gen)
    offsets = torch.arange(context + 1)
    window = ids[start[:, None] + offsets]  # (B, T + 1)
    return window[:, :-1], window[:, 1:]


def char_windows(ids: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """All non-overlapping windows of `ids` (for evaluation): inputs and targets `(N, T)`."""
    n = (len(ids) - 1) // context
    x = ids[: n * context].reshape(n, context)
    y = ids[1 : n * context + 1].reshape(n, context)
    return x, y


def digits_split(val_fraction: float = 0.2, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as `(x_train, y_train, x_val, y_val)`, stratified.

    Images are `(N, 1, 8, 8)` float32 scaled to [0, 1] (raw pixel values are 0..16); labels
    are int64 in 0..9.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    index = list(range(len(y)))
    train, val = train_test_split(
        index, test_size=val_fraction, random_state=seed, stratify=digits.target
    )
    return x[train], y[train], x[val], y[val]
