"""`gb.apply`: g-net parameters in, every p-net parameter out, as a pure function."""

import functools
import math
from collections.abc import Callable, Hashable

import torch
from einops import rearrange
from torch import Tensor

from ._backend import fused_weights, use_triton
from ._checks import check_gparams
from ._genome import hash_buckets, stack_codes
from ._plan import Generated, Plan, Stack
from ._tilemlp import Terms, reference, tile_mlp

GParams = dict[str, dict]
Tensors = tuple[Tensor, Tensor]
# Hashed tables are stored divided by this, so one learning rate suits them and the g-nets:
# measured on the digits CNN at ~23x, a table at the g-net's Adam rate reached 93.98%, at 10x
# that rate 97.68% (3 seeds, the variance split evenly between table and g-nets at init).
HASH_GAIN = 10.0
# `gb.apply(compile=None)` compiles a stack's tile MLP in eager mode from this many elements of
# its transient `(T, TH, Q, H)` on (about 1M): a stack that large costs milliseconds per step
# eagerly, and its compile (a few seconds) pays back within a few thousand steps. Measured on
# the MLP's full-tile hashed genome (stacks of 1.0-1.6M): 34-37 ms eager, 11-15 ms compiled.
AUTO_COMPILE_ELEMENTS = 1 << 20


def apply(
    gparams: GParams,
    plan: Plan,
    *,
    check: bool = False,
    backend: str = "auto",
    compile: bool | None = None,
) -> dict[str, Tensor]:
    """Generate every parameter of the p-net described by `plan`.

    Each stack's g-nets are evaluated on their tiles in one batched call; tiles are laid out
    on each weight's grid, cut to its shape and scaled. Free parameters pass through. Pure:
    no module is touched, so it composes with `torch.func.grad`, `vmap` and `torch.compile`.

    Args:
        gparams: From `gb.init(plan, ...)` (or trained from it).
        plan: The plan that made `gparams`.
        check: Also reject NaN or inf in `gparams` (reads values: not for compiled code).
        backend: `"torch"`, `"triton"` (fused kernels, `gbfunc.kernels`; through Triton's
            interpreter on CPU) or `"auto"`: Triton for CUDA tensors, torch otherwise.
        compile: On the torch backend, called eagerly (not under `torch.compile` or a
            `torch.func` transform), run each stack's g-net evaluation, forward and backward,
            as code compiled once per stack signature and cached; the first call of a new
            signature compiles (seconds). `None`: only for stacks of at least
            `AUTO_COMPILE_ELEMENTS` hidden activations, where it pays. `False`: never (for
            debugging). The result is the same either way, to rounding.

    Returns:
        `{name: tensor}` for every parameter, ready for
        `torch.func.functional_call(model, params, args)`.

    Example:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> params = gb.apply(gb.init(plan), plan)
        >>> torch.func.functional_call(model, params, (torch.randn(2, 64),)).shape
        torch.Size([2, 32])
    """
    check_gparams(gparams, plan, "gb.apply", values=check)
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"gb.apply: compile must be True, False or None, got {compile!r}.")
    stacks = gparams["stacks"]
    if use_triton(backend, plan, stacks):
        generated = fused_weights(plan, [stack_terms(s, stacks[s.key]) for s in plan.stacks])
        hashed = {  # linear in the tiles, so laid out on its own and added to the kernels'
            s.key: hashed_tiles(s, stacks[s.key]["tile_hash"])
            for s in plan.stacks
            if s.genome.hashed
        }
        for p in plan.generated:  # the kernels scale; centring reads whole rows, done here
            stack = plan.stacks[p.stack]
            if p.center:
                generated[p.name] = center_rows(generated[p.name])
            if stack.key in hashed:
                generated[p.name] = generated[p.name] + assemble(p, stack, hashed[stack.key])
    else:
        tiles = [
            evaluate_stack(s, stacks[s.key], compiled=_compiles(s, compile)) for s in plan.stacks
        ]
        generated = {
            p.name: assemble(p, plan.stacks[p.stack], tiles[p.stack]) for p in plan.generated
        }
    return parameters(plan, gparams, lambda p: generated[p.name])


def parameters(
    plan: Plan, gparams: GParams, generated: Callable[[Generated], Tensor]
) -> dict[str, Tensor]:
    """Every parameter in `plan` order: `generated(p)` for generated ones, the rest from
    `gparams["free"]` or `gparams["frozen"]`."""
    return {
        p.name: generated(p)
        if isinstance(p, Generated)
        else gparams["free" if p.trainable else "frozen"][p.name]
        for p in plan.params
    }


def _compiles(stack: Stack, compile: bool | None) -> bool:
    """Whether `gb.apply(compile=compile)` runs this stack's tile MLP compiled when eager."""
    if compile is not None:
        return compile
    work = stack.num_tiles * stack.tile[0] * stack.columns * stack.genome.hidden
    return work >= AUTO_COMPILE_ELEMENTS


def evaluate_stack(
    stack: Stack, leaves: dict[str, Tensor], *, recompute: bool = True, compiled: bool = False
) -> Tensor:
    """Every tile of a stack, `(T, TH, TW * K)`: one batched g-net evaluation.

    Args:
        stack: The stack's description.
        leaves: Its parameters, `gparams["stacks"][stack.key]`.
        recompute: Use the recomputing backward (`tile_mlp`); False runs plain autograd.
        compiled: Run `tile_mlp` eagerly through compiled code (see `gb.apply`).
    """
    terms = stack_terms(stack, leaves)
    if recompute:
        y = tile_mlp(terms, stack.genome.activation, compiled)  # (T, TH, Q, P)
    else:
        y = reference(terms, stack.genome.activation)
    y = y.reshape(y.shape[0], y.shape[1], -1)
    return y + hashed_tiles(stack, leaves["tile_hash"]) if stack.genome.hashed else y


def hashed_tiles(stack: Stack, table: Tensor) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`."""
    positions = stack.tile[0] * stack.columns * stack.outputs
    bucket, sign = _constant(_hash_on, positions, stack.genome.hashed, table.dtype, table.device)
    shared = table.index_select(1, bucket) * (sign * HASH_GAIN)
    return shared.reshape(table.shape[0], stack.tile[0], -1)


def stack_terms(stack: Stack, leaves: dict[str, Tensor]) -> Terms:
    """A stack's g-nets as per-tile `Terms`, from its leaves in `gparams["stacks"]`.

    The code tables go through the first layer here (`a`, `b`); `c` is its bias plus the
    tile embedding when g-nets are shared, and shared g-nets are repeated over their tiles.
    """
    w_in = leaves["w_in"]
    row, col = _constant(
        stack_codes, stack.tile, stack.kernel, stack.genome, stack.columns, w_in.dtype, w_in.device
    )
    r = stack.row_width
    a = row @ w_in[:, :r]  # (G, TH, H)
    b = col @ w_in[:, r:]  # (G, Q, H)
    c = leaves["b_in"]  # (G, H)
    w_hidden, b_hidden = leaves.get("w_hidden"), leaves.get("b_hidden")
    w_out, b_out = leaves["w_out"], leaves["b_out"]
    if stack.genome.share:
        counts = stack.tiles_per_gnet
        w_embed = _per_tile(leaves["w_embed"], counts)  # (T, E, H)
        c = _per_tile(c, counts) + torch.einsum("te,teh->th", leaves["tile_embed"], w_embed)
        a, b, w_out, b_out = (_per_tile(x, counts) for x in (a, b, w_out, b_out))
        if w_hidden is not None:
            w_hidden, b_hidden = _per_tile(w_hidden, counts), _per_tile(b_hidden, counts)
    return Terms(a, b, c, w_hidden, b_hidden, w_out, b_out)


def assemble(p: Generated, stack: Stack, tiles: Tensor) -> Tensor:
    """Lay a parameter's tiles out on its grid, cut to its shape and scale it."""
    tw = stack.tile[1]
    taps = math.prod(stack.kernel)
    parts = []
    for block in p.blocks:
        rows, cols = block.grid
        t = tiles[block.first_tile : block.first_tile + block.num_tiles]  # (R*C, TH, TW*K)
        t = rearrange(t, "(r c) th (tw k) -> (r th) (c tw) k", r=rows, c=cols, tw=tw, k=taps)
        parts.append(t[: block.rows, : block.cols])
    weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=p.split_dim)
    return finish(p, weight.reshape(p.shape))


def finish(p: Generated, raw: Tensor) -> Tensor:
    """A parameter from its laid-out raw values `(rows, ...)`: centred rows if asked, scaled."""
    return (center_rows(raw) if p.center else raw) * p.scale


def center_rows(weight: Tensor) -> Tensor:
    """`weight` less each row's mean over its inputs (every dimension but the first)."""
    return weight - weight.mean(dim=tuple(range(1, weight.dim())), keepdim=True)


def _constant(make: Callable[..., Tensors], *args: Hashable) -> Tensors:
    """`make(*args)`, tensors fixed by the plan (codes, hash tables), cached per arguments.

    Under `torch.compile` they are built in the graph instead and traced once into constants.
    """
    if torch.compiler.is_compiling():
        return make(*args)
    return _cached(make, *args)


@functools.lru_cache(maxsize=256)
def _cached(make: Callable[..., Tensors], *args: Hashable) -> Tensors:
    return make(*args)


def _hash_on(
    positions: int, buckets: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """`hash_buckets` on `device`, the signs in `dtype`."""
    bucket, sign = hash_buckets(positions, buckets)
    return bucket.to(device), sign.to(dtype=dtype, device=device)


def _per_tile(x: Tensor, counts: tuple[int, ...]) -> Tensor:
    """Repeat each g-net's row of `x` over its (consecutive) tiles: `(G, ...) -> (T, ...)`.

    Built from expands and one cat, so the backward is a sum per g-net; indexing would make
    it a scatter-add, which inductor's CPU code generation fails on (torch 2.13).
    """
    return torch.cat([x[g : g + 1].expand(n, *x.shape[1:]) for g, n in enumerate(counts)])
