"""Statistics over seeds: each arm's mean, standard error and spread, and whether a gap
between two arms, paired by seed, is beyond noise (a two-sided paired t-test at 5%)."""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scipy.stats import t as student_t

# The test's level: a gap is "beyond noise" where a two-sided paired t-test rejects "no gap"
# at this level. With 3 seeds that takes |gap| > 4.30 s.e., with 5 seeds 2.78 s.e.: twice the
# s.e., whatever the seeds, would be a test at 18% for 3 seeds.
LEVEL = 0.05


def critical(n: int) -> float:
    """How many standard errors a gap over `n` paired seeds must exceed (Student's t)."""
    return float(student_t.ppf(1 - LEVEL / 2, n - 1))


def rule(counts: Iterable[int]) -> str:
    """The labels' rule, with t at each number of paired seeds in `counts` (one seed has
    no t: its gap is not labelled)."""
    ts = [f"{critical(n):.2f} at {n}" for n in sorted(set(counts)) if n > 1]
    if not ts:
        return "beyond noise: a paired t-test at 5% (one seed: no gap is labelled)"
    ts[0] += " seeds"
    return "beyond noise: a paired t-test at 5%, |gap| > t s.e. (t = " + ", ".join(ts) + ")"


@dataclass(frozen=True)
class Stat:
    """Mean, standard error (`nan` for one value) and spread (max - min) of per-seed values."""

    mean: float
    se: float
    spread: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stat":
        n = len(values)
        mean = sum(values) / n
        var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else math.nan
        return cls(mean, math.sqrt(var / n), max(values) - min(values), n)

    @property
    def label(self) -> str:
        """For a gap: `beyond noise` when |mean| > `critical(n)` s.e., else `within noise`."""
        if self.n < 2:
            return "not ranked (one seed)"
        return "beyond noise" if abs(self.mean) > critical(self.n) * self.se else "within noise"


def paired_gap(a: Sequence[float], b: Sequence[float]) -> Stat:
    """`a - b` seed by seed, over the seeds both have (`a` and `b` in seed order)."""
    n = min(len(a), len(b))
    return Stat.of([x - y for x, y in zip(a[:n], b[:n], strict=True)])
