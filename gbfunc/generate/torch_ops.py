"""The `torch` path: pure torch, op by op, with a recomputing backward (`_tilemlp.tile_mlp`);
traced by `torch.compile`, inductor's code (on CPU calling the C loops' sub-ops where
`gbfunc.cpu` has them built). It always applies: the fallback of every other path.
"""

from collections.abc import Mapping, Sequence

from torch import Tensor

from .._evaluate import evaluate_tile_parts
from .._plan import Stack
from ._policy import Call

NAME = "torch"


def refuses(call: Call) -> str | None:
    """None: pure torch generates every stack."""
    return None


def tiles(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    indices: Sequence[int],
    spans: Sequence[tuple[int, int]] | None,
) -> tuple[Tensor, ...]:
    """Tiles `indices` of `stack`, `(len(indices), TH, TW * K)`, op by op, cut into `spans`
    (consecutive ranges of positions in `indices`; None: one part)."""
    return evaluate_tile_parts(stack, leaves, indices, spans)
