"""Real data that ships with Python or a package, so nothing is downloaded at run time.

- `pydoc_text`: the text of Python's own help topics (`pydoc_data.topics`, ~465k characters).
- `CharCorpus`: a text as character ids, split into train and validation (and test).
- `pydoc_held_out`: those topics split into train, validation and a test part no choice
  was made on.
- `digits_split`: scikit-learn's handwritten digits (1797 8x8 images, 10 classes);
  `digits_held_out` the same with a test set no choice was made on.
"""

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


def pydoc_topics() -> dict[str, str]:
    """The help topics of the running Python by name, in sorted-name order."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def pydoc_text() -> str:
    """The help topics of the running Python, joined in a fixed (sorted-name) order."""
    return "\n".join(pydoc_topics().values())


def pydoc_held_out(test_fraction: float = 0.1) -> tuple[str, str, str]:
    """Python's help topics as `(train, validation, test)` texts, split by topic.

    Validation: the topics in the last tenth of `pydoc_text`, the validation part of
    `CharCorpus.from_text(pydoc_text())` on which `benchmarks.equal_params` chose rates and
    sizes (it now trains on this training part and chooses on this validation part). Test:
    topics of the rest, taken in a fixed shuffled order while they fit in `test_fraction` of
    the characters; nothing was ever chosen on them. Training: the other topics. Topics
    repeat each other (`compound` holds `while`, `with` and `try`), so the paragraphs of
    validation that also occur in training, and those of test that occur in either, are
    dropped: no held-out paragraph was seen in training.
    """
    topics = pydoc_topics()
    cut = int(len("\n".join(topics.values())) * 0.9)  # where `from_text`'s validation starts
    validation, start = [], 0
    for name, text in topics.items():
        if start + len(text) > cut:
            validation.append(name)
        start += len(text) + 1
    rest = [name for name in topics if name not in validation]
    order = rest.copy()
    random.Random(0).shuffle(order)
    test, size, budget = set(), 0, test_fraction * start
    for name in order:
        if size + len(topics[name]) <= budget:
            test.add(name)
            size += len(topics[name])
    train = "\n".join(topics[name] for name in rest if name not in test)
    trained = _paragraphs(train)
    val = _unseen((topics[name] for name in validation), trained)
    seen = trained | _paragraphs(val)
    return train, val, _unseen((topics[name] for name in rest if name in test), seen)


def _paragraphs(text: str) -> set[str]:
    return {p.strip() for p in text.split("\n\n")}


def _unseen(texts: Iterable[str], seen: set[str]) -> str:
    """`texts` joined, each without its paragraphs in `seen`."""
    kept = ("\n\n".join(p for p in t.split("\n\n") if p.strip() not in seen) for t in texts)
    return "\n".join(kept)


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: vocabulary and the train/validation id sequences.

    Attributes:
        chars: The vocabulary; id `i` is `chars[i]`.
        train: Ids of the training text, `(N_train,)` int64.
        val: Ids of the validation text, `(N_val,)` int64.
        test: Ids of the test text, `(N_test,)` int64, where there is one.
    """

    chars: str
    train: Tensor
    val: Tensor
    test: Tensor | None = None

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

    @classmethod
    def from_parts(cls, train: str, val: str, test: str) -> "CharCorpus":
        """Build the vocabulary from the three texts together; each is its own part."""
        chars = "".join(sorted(set(train) | set(val) | set(test)))
        index = {ch: i for i, ch in enumerate(chars)}
        train_ids, val_ids, test_ids = (
            torch.tensor([index[ch] for ch in text], dtype=torch.int64)
            for text in (train, val, test)
        )
        return cls(chars, train_ids, val_ids, test_ids)

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


def digits_held_out(
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's digits as `(x_train, y_train, x_val, y_val, x_test, y_test)`, stratified.

    Test: 360 images (a fifth) of the training part of `digits_split(seed=0)`, the same for
    every seed; `benchmarks.equal_params` chose rates and sizes on that split's validation
    part, never on these (it now trains and chooses on seed 0's other two parts). `seed`
    splits the other 1437 images into 1077 for training and 360 for validation. Images and
    labels as in `digits_split`.
    """
    from sklearn.model_selection import train_test_split

    x, y, x_chosen_on, y_chosen_on = digits_split(seed=0)
    rest, test = train_test_split(range(len(y)), test_size=360, random_state=0, stratify=y)
    x_pool, y_pool = torch.cat([x[rest], x_chosen_on]), torch.cat([y[rest], y_chosen_on])
    train, val = train_test_split(
        range(len(y_pool)), test_size=360, random_state=seed, stratify=y_pool
    )
    return x_pool[train], y_pool[train], x_pool[val], y_pool[val], x[test], y[test]
