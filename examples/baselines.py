"""Equal-parameter baselines for compression results: low rank and hashed weight sharing.

A compression number means something only next to the obvious alternatives with the same
number of trainable parameters: a narrower dense model (`examples.training.narrowest_match`,
the same architecture at the width whose parameter count is nearest) and, here,

- `low_rank`: every chosen weight as `U @ V.T` (conv kernels as their `(out, in * k)` matrix
  view), ranks spread over the matrices in proportion to their sizes so that the factors
  together hold a target count; every other parameter trained as it is;
- `hashed`: HashedNets (Chen et al. 2015, "Compressing neural networks with the hashing
  trick"): every entry of a chosen weight reads one of a few shared values through a fixed
  random hash, times a fixed random sign; values spread over the weights by size.
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

Tree = dict[str, Tensor]


def low_rank(
    model: nn.Module, names: Sequence[str], budget: int, *, seed: int = 0
) -> tuple[Tree, Callable[[Tree], Tree]]:
    """Factor `names` as `U @ V.T` within `budget` factor parameters; the rest stays as it is.

    Each matrix `(M, N)` gets rank `max(1, round(share / (M + N)))`, where `share` is its
    fraction of `budget` by size. Factors start so that `U @ V.T` has the dense weight's std.

    Returns:
        `(tree, to_params)`: the trainable tensors, and the function that turns them into the
        model's parameters for `torch.func.functional_call`.
    """
    params = dict(model.named_parameters())
    total = sum(params[n].numel() for n in names)
    gen = torch.Generator().manual_seed(seed)
    tree: Tree = {}
    shapes: dict[str, torch.Size] = {}
    for name, value in params.items():
        if name not in names:
            tree[name] = value.detach().clone().requires_grad_()
            continue
        rows, cols = value.shape[0], value[0].numel()
        rank = max(1, round(budget * value.numel() / total / (rows + cols)))
        rank = min(rank, rows, cols)
        std = math.sqrt(float(value.detach().std()) / math.sqrt(rank))
        tree[f"{name}.U"] = (torch.randn(rows, rank, generator=gen) * std).requires_grad_()
        tree[f"{name}.V"] = (torch.randn(cols, rank, generator=gen) * std).requires_grad_()
        shapes[name] = value.shape

    def to_params(tree: Tree) -> Tree:
        out = {k: v for k, v in tree.items() if not k.endswith((".U", ".V"))}
        for name, shape in shapes.items():
            out[name] = (tree[f"{name}.U"] @ tree[f"{name}.V"].T).reshape(shape)
        return out

    return tree, to_params


def weight_matrices(model: nn.Module) -> list[str]:
    """Names of `model`'s parameters with 2 or more dims: the weights low rank factors."""
    return [name for name, value in model.named_parameters() if value.dim() >= 2]


def smallest_low_rank(model: nn.Module, names: Sequence[str]) -> int:
    """Parameters of `low_rank`'s smallest model: rank 1 for each of `names`, the rest as is."""
    params = dict(model.named_parameters())
    free = sum(v.numel() for k, v in params.items() if k not in names)
    return free + sum(params[k].shape[0] + params[k][0].numel() for k in names)


def factor_budget(model: nn.Module, names: Sequence[str], target: int) -> int | None:
    """Parameters left for `low_rank`'s factors of `names` when the whole model holds `target`.

    `None` when `target` is below `smallest_low_rank`: low rank cannot get that small.
    """
    if target < smallest_low_rank(model, names):
        return None
    return target - sum(v.numel() for k, v in model.named_parameters() if k not in names)


def hashed(
    model: nn.Module, names: Sequence[str], budget: int, *, seed: int = 0
) -> tuple[Tree, Callable[[Tree], Tree]]:
    """Share `names`' entries among `budget` trained values by a fixed hash; the rest as is.

    Each weight gets `max(1, round(budget * share))` values, `share` its fraction of the
    chosen weights by size, drawn with the dense weight's std; each entry reads a uniformly
    random one of them (the hash, fixed by `seed`) times a random sign (as in the paper).

    Returns:
        `(tree, to_params)`, as `low_rank`.
    """
    params = dict(model.named_parameters())
    total = sum(params[n].numel() for n in names)
    gen = torch.Generator().manual_seed(seed)
    tree: Tree = {}
    hashes: dict[str, tuple[Tensor, Tensor]] = {}
    for name, value in params.items():
        if name not in names:
            tree[name] = value.detach().clone().requires_grad_()
            continue
        size = max(1, round(budget * value.numel() / total))
        std = float(value.detach().std())
        tree[f"{name}.pool"] = (torch.randn(size, generator=gen) * std).requires_grad_()
        index = torch.randint(size, value.shape, generator=gen)
        sign = torch.randint(2, value.shape, generator=gen).float() * 2 - 1
        hashes[name] = (index, sign)

    def to_params(tree: Tree) -> Tree:
        out = {k: v for k, v in tree.items() if not k.endswith(".pool")}
        for name, (index, sign) in hashes.items():
            out[name] = tree[f"{name}.pool"][index] * sign
        return out

    return tree, to_params


def tree_count(tree: Tree) -> int:
    """Trainable elements of a tree."""
    return sum(v.numel() for v in tree.values() if v.requires_grad)
