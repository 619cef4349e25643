"""An unstacked, unfused reference for gbfunc: one explicit MLP per tile, no separable trick.

Independent of `gbfunc._tilemlp` and `gbfunc._apply`: it builds the full code matrix of every
position, runs each tile's g-net as a plain MLP, and places the tiles by explicit indexing.
"""

import math

import torch
from torch import Tensor

from gbfunc import Generated, Plan
from gbfunc._genome import stack_codes
from gbfunc._tilemlp import activate


def naive_apply(gparams: dict, plan: Plan) -> dict[str, Tensor]:
    out = {}
    for p in plan.params:
        if not isinstance(p, Generated):
            out[p.name] = gparams["free" if p.trainable else "frozen"][p.name]
            continue
        stack = plan.stacks[p.stack]
        leaves = gparams["stacks"][stack.key]
        th, tw = stack.tile
        taps = math.prod(stack.kernel)
        row, col = stack_codes(
            stack.tile, stack.kernel, stack.genome, stack.columns, leaves["w_in"].dtype, None
        )
        codes = torch.cat(
            [
                row[:, None, :].expand(-1, col.shape[0], -1),
                col[None, :, :].expand(row.shape[0], -1, -1),
            ],
            -1,
        )  # (TH, Q, R + C)
        owner = [g for g, n in enumerate(stack.tiles_per_gnet) for _ in range(n)]
        blocks = []
        for block in p.blocks:
            full = torch.zeros(block.grid[0] * th, block.grid[1] * tw, taps, dtype=codes.dtype)
            for k in range(block.num_tiles):
                t = block.first_tile + k
                g = owner[t]
                h = codes @ leaves["w_in"][g] + leaves["b_in"][g]
                if stack.genome.share:
                    h = h + leaves["tile_embed"][t] @ leaves["w_embed"][g]
                h = activate(h, stack.genome.activation)
                for layer in range(stack.genome.depth - 1):
                    h = activate(
                        h @ leaves["w_hidden"][g, layer] + leaves["b_hidden"][g, layer],
                        stack.genome.activation,
                    )
                y = (h @ leaves["w_out"][g] + leaves["b_out"][g]).reshape(
                    th, tw, taps
                )  # (TH, Q, P) -> tile
                r, c = divmod(k, block.grid[1])
                full = full.index_put(
                    (
                        torch.arange(r * th, (r + 1) * th)[:, None],
                        torch.arange(c * tw, (c + 1) * tw)[None, :],
                    ),
                    y,
                )
            blocks.append(full[: block.rows, : block.cols])
        weight = torch.cat(blocks, dim=p.split_dim) if len(blocks) > 1 else blocks[0]
        out[p.name] = weight.reshape(p.shape) * p.scale
    return out
