"""Checks that a plan read from a file is one `gb.plan` could have made for the model.

A checkpoint's SHA-256 shows the file is whole, not that `gb.save` wrote it: a crafted file
can carry any plan with a recomputed hash. Everything `gb.init`, `gb.apply` and `gb.load`
size their work by (stack indices, tiles, grids, blocks, scales, dtypes) is checked here
against the model's shapes before `gb.load` builds anything from it, so that a crafted plan
is refused rather than allocating without bound or generating NaN.
"""

import math

import torch
from torch import nn

from ._check_model import check_matches
from ._entries import check_labels
from ._genome import Genome
from ._numbers import as_finite, as_integer
from ._plan import Block, Free, Generated, Plan, Stack, block_shapes, stack_geometry, tile_grid

# What `gb.init` can draw a free tensor by (`free_init`).
FREE_INITS = ("zeros", "ones", "uniform", "normal", "normal_padded")


class _Bad(Exception):
    """A field of the plan is malformed or inconsistent; the message names it."""


def check_plan(
    plan: Plan,
    model: nn.Module | None,
    where: str,
    *,
    corrupt: type[Exception],
    mismatch: type[Exception],
) -> None:
    """Raise unless `plan` is a well-formed, self-consistent plan for `model`.

    Checks, in order: every field's type and range (`corrupt`); names and shapes against
    `model` (`mismatch`); then that each stack's geometry follows from its genome and tile,
    that every block tiles its part of the parameter exactly (tiles clipped to the block,
    as `gb.plan` clips them), and that the blocks of each stack cover its tiles once each,
    so no two parameters share tiles (`corrupt`). Generated elements are then exactly the
    model's, and tiles exceed them only by the padding `gb.plan` itself produces.

    Args:
        plan: Deserialised plan.
        model: The p-net it must describe; None (a save whose model is gone): the names
            and shapes are not checked.
        where: Prefix of messages, e.g. `"gb.load: ckpt.safetensors"`.
        corrupt: Exception class for a malformed or inconsistent plan.
        mismatch: Exception class for a plan of another model.
    """
    try:
        _check_fields(plan)
    except _Bad as e:
        raise corrupt(f"{where}: the plan is malformed: {e}") from None
    if model is not None:
        check_matches(plan, model, where, "the checkpoint", mismatch)
    try:
        _check_layout(plan)
    except _Bad as e:
        raise corrupt(f"{where}: the plan is inconsistent: {e}") from None


def _is_int(x: object, low: int) -> bool:
    n = as_integer(x)
    return n is not None and n >= low


def _ints(x: object, low: int, length: int | None = None) -> bool:
    return (
        isinstance(x, tuple)
        and (length is None or len(x) == length)
        and all(_is_int(v, low) for v in x)
    )


def _need(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise _Bad(f"{field} is {value!r:.100}; expected {expected}.")


def _dtype(field: str, name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    _need(isinstance(dtype, torch.dtype), field, name, "a torch dtype name such as 'float32'")
    return dtype


def _check_fields(plan: Plan) -> None:
    """Types and ranges of every field, one at a time."""
    _need(isinstance(plan.params, tuple), "params", type(plan.params).__name__, "a list")
    _need(isinstance(plan.stacks, tuple), "stacks", type(plan.stacks).__name__, "a list")
    for i, p in enumerate(plan.params):
        _check_param_fields(plan, i, p)
    keys: set[str] = set()
    for j, s in enumerate(plan.stacks):
        _check_stack_fields(j, s, keys)
    widths = {s.genome.condition for s in plan.stacks} - {0}
    _need(len(widths) <= 1, "the stacks' genome.condition", sorted(widths), "one width (or 0)")
    _need(_is_int(plan.tasks, 0), "tasks", plan.tasks, "an int >= 0")
    _need(not plan.tasks or bool(widths), "tasks", plan.tasks, "0 where no stack is conditioned")


def _check_param_fields(plan: Plan, i: int, p: object) -> None:
    """Types and ranges of the fields of parameter `i`, `p`."""
    at = f"params[{i}]"
    _need(isinstance(p, Generated | Free), at, type(p).__name__, "a parameter")
    _need(isinstance(p.name, str) and p.name != "", f"{at}.name", p.name, "a name")
    at = f"{at} ({p.name!r:.80})"
    _need(_ints(p.shape, 0), f"{at}.shape", p.shape, "a list of sizes >= 0")
    dtype = _dtype(f"{at}.dtype", p.dtype)
    grad = dtype.is_floating_point or dtype.is_complex  # what requires_grad allows
    if isinstance(p, Free):
        init = p.init
        ok = isinstance(init, tuple) and len(init) == 2 and init[0] in FREE_INITS
        ok = ok and as_finite(init[1]) is not None
        _need(ok, f"{at}.init", init, f"[kind, value], kind in {FREE_INITS}")
        if init[0] == "normal_padded":  # value: the padding row
            row = as_integer(init[1])
            ok = row is not None and len(p.shape) >= 1 and 0 <= row < p.shape[0]
            _need(ok, f"{at}.init", init, "['normal_padded', a row of the table]")
        _need(isinstance(p.trainable, bool), f"{at}.trainable", p.trainable, "a bool")
        _need(grad or not p.trainable, f"{at}.dtype", p.dtype, "a floating dtype (trainable)")
        _need(isinstance(p.reason, str), f"{at}.reason", p.reason, "a string")
        return
    _need(grad, f"{at}.dtype", p.dtype, "a floating dtype")
    _need(len(p.shape) >= 1 and 0 not in p.shape, f"{at}.shape", p.shape, "a non-empty shape")
    if not (_is_int(p.stack_index, 0) and p.stack_index < len(plan.stacks)):
        raise _Bad(
            f"{at} names stack {p.stack_index!r:.100}; the plan has {len(plan.stacks)} stacks."
        )
    _need(_is_int(p.split_dim, 0) and p.split_dim <= 1, f"{at}.split_dim", p.split_dim, "0 or 1")
    # A generated weight's scale is its std (`gb.plan` measures it), which the parameter's
    # dtype bounds; a crafted plan with a larger one would generate inf.
    scale, largest = as_finite(p.scale), torch.finfo(dtype).max
    ok = scale is not None and 0 < scale <= largest
    _need(ok, f"{at}.scale", p.scale, f"a number in (0, {largest:g}], the largest {p.dtype}")
    _need(_is_int(p.fan_in, 1), f"{at}.fan_in", p.fan_in, "an integer >= 1")
    _need(isinstance(p.center, bool), f"{at}.center", p.center, "a bool")
    start = as_finite(p.start)
    ok = start is not None and start > 0 and start * scale <= largest
    _need(ok, f"{at}.start", p.start, f"a number > 0 with scale * start <= {largest:g}")
    _need(isinstance(p.blocks, tuple) and len(p.blocks) > 0, f"{at}.blocks", p.blocks, "blocks")
    for k, b in enumerate(p.blocks):
        bt = f"{at}.blocks[{k}]"
        _need(isinstance(b, Block), bt, b, "a block")
        _need(_is_int(b.rows, 1), f"{bt}.rows", b.rows, "an integer >= 1")
        _need(_is_int(b.cols, 1), f"{bt}.cols", b.cols, "an integer >= 1")
        _need(_ints(b.grid, 1, 2), f"{bt}.grid", b.grid, "[rows, cols] >= 1")
        if not _is_int(b.first_tile, 0):
            raise _Bad(f"{bt}.first_tile is {b.first_tile!r:.100}, outside its stack.")


def _check_stack_fields(j: int, s: object, keys: set[str]) -> None:
    """Types and ranges of the fields of stack `j`, `s`; `keys` collects the stack keys seen."""
    at = f"stacks[{j}]"
    _need(isinstance(s, Stack), at, type(s).__name__, "a stack")
    ok = isinstance(s.key, str) and s.key != "" and "/" not in s.key and s.key not in keys
    _need(ok, f"{at}.key", s.key, "a unique name without '/'")
    keys.add(s.key)
    _need(isinstance(s.genome, Genome), f"{at}.genome", s.genome, "a genome")
    _need(_ints(s.tile, 1, 2), f"{at}.tile", s.tile, "[th, tw] >= 1")
    _need(_ints(s.window, 1), f"{at}.window", s.window, "a list of sizes >= 1")
    for field in ("outputs", "columns", "row_width", "col_width"):
        _need(_is_int(getattr(s, field), 1), f"{at}.{field}", getattr(s, field), "an integer >= 1")
    _need(
        _ints(s.tiles_per_gnet, 1) and len(s.tiles_per_gnet) > 0,
        f"{at}.tiles_per_gnet",
        s.tiles_per_gnet,
        "a list of counts >= 1",
    )


def _check_layout(plan: Plan) -> None:
    """Blocks against shapes and tiles, stacks against genomes, tiles against blocks."""
    owners: list[list[tuple[int, int, str]]] = [[] for _ in plan.stacks]  # (first, tiles, who)
    for i, p in enumerate(plan.params):
        if not isinstance(p, Generated):
            continue
        at = f"params[{i}] ({p.name!r})"
        s = plan.stacks[p.stack_index]
        _need(
            s.window == p.shape[2:],
            f"stacks[{p.stack_index}].window",
            s.window,
            f"{p.shape[2:]}, the kernel window of {at}",
        )
        _need(not (p.center and len(p.shape) == 1), f"{at}.center", p.center, "False for a vector")
        for k, (b, (rows, cols)) in enumerate(zip(p.blocks, _blocks(p, at), strict=True)):
            bt = f"{at}.blocks[{k}]"
            _need(
                (b.rows, b.cols) == (rows, cols),
                f"{bt}",
                f"{b.rows}x{b.cols}",
                f"{rows}x{cols} for shape {p.shape} split {len(p.blocks)}-ways on dim "
                f"{p.split_dim}",
            )
            outputs = s.genome.outputs
            _need(
                outputs <= cols,
                f"stacks[{p.stack_index}].genome.outputs",
                outputs,
                f"at most the {cols} columns of {bt}",
            )
            th, tw = s.tile
            _need(
                th <= rows and tw <= -(-cols // outputs) * outputs,
                f"stacks[{p.stack_index}].tile",
                s.tile,
                f"a tile no larger than {bt} ({rows}x{cols}), as gb.plan clips it",
            )
            grid = tile_grid(rows, cols, s.tile)
            _need(
                b.grid == grid, f"{bt}.grid", b.grid, f"{grid} for {rows}x{cols} on {th}x{tw} tiles"
            )
            try:
                check_labels(p.name, s.genome, rows, cols, s.tile)
            except ValueError as e:
                raise _Bad(str(e).removeprefix("gb.plan: ")) from None
            owners[p.stack_index].append((b.first_tile, b.num_tiles, bt))
    for j, s in enumerate(plan.stacks):
        _check_stack(f"stacks[{j}]", s, sorted(owners[j]))


def _blocks(p: Generated, at: str) -> list[tuple[int, int]]:
    """`(rows, cols)` of each block of `p`, as `gb.plan` splits it."""
    if len(p.shape) == 1:  # a bias: one column of output neurons
        rows, cols = p.shape[0], 1
    else:
        rows, cols = p.shape[0], p.shape[1]
    n = len(p.blocks)
    if n == 1:
        _need(p.split_dim == 0, f"{at}.split_dim", p.split_dim, "0 for one block")
        return [(rows, cols)]
    _need(len(p.shape) > 1, f"{at}.blocks", f"{n} blocks", "one block for a vector")
    size = (rows, cols)[p.split_dim]
    _need(size % n == 0, f"{at}.blocks", f"{n} blocks", f"a divisor of {size}")
    return block_shapes(p.shape, n, p.split_dim)


def _check_stack(at: str, s: Stack, owners: list[tuple[int, int, str]]) -> None:
    _need(len(owners) > 0, at, s.key, "a stack that generates some block")
    taps = math.prod(s.window)
    genome = s.genome
    if taps > 1:
        _need(genome.outputs == 1, f"{at}.genome.outputs", genome.outputs, "1 for a kernel")
    else:
        _need(
            s.tile[1] % genome.outputs == 0,
            f"{at}.tile",
            s.tile,
            f"a width that is a multiple of outputs={genome.outputs}",
        )
    geometry = (s.outputs, s.columns, s.row_width, s.col_width)
    want = stack_geometry(genome, s.tile, s.window)
    _need(
        geometry == want,
        f"{at} (outputs, columns, row_width, col_width)",
        geometry,
        f"{want} for its genome, tile and kernel",
    )
    end, previous = 0, ""
    for first, tiles, who in owners:  # sorted by first tile
        if first + tiles > s.num_tiles:
            raise _Bad(
                f"{who} (tiles {first} to {first + tiles - 1}) is outside its stack {s.key!r} "
                f"of {s.num_tiles} tiles."
            )
        if first < end:
            raise _Bad(f"{previous} and {who} both claim tiles of {s.key!r} from tile {first}.")
        end, previous = first + tiles, who
    end = 0
    for first, tiles, _ in [*owners, (s.num_tiles, 0, "")]:  # disjoint now: look for gaps
        if first > end:
            raise _Bad(f"tiles {end} to {first - 1} of {s.key!r} belong to no block.")
        end = first + tiles
    if genome.share:
        counts = tuple(tiles for _, tiles, _ in owners)
        _need(
            s.tiles_per_gnet == counts,
            f"{at}.tiles_per_gnet",
            s.tiles_per_gnet,
            f"{counts}, one g-net per block (share=True)",
        )
    else:
        _need(
            all(c == 1 for c in s.tiles_per_gnet),
            f"{at}.tiles_per_gnet",
            s.tiles_per_gnet,
            "all ones, one g-net per tile",
        )
