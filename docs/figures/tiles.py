"""Draw the documentation's concept figure: tile-and-cut, writing `docs/figures/tiles.png`.

Three panels, drawn 7.15 in wide at 200 dpi (the site shows figures 688 CSS px wide: at that
width every point size reads at its nominal size, none under 8 pt): panel 1 on top with its
caption beside it, panels 2 -> 3 below, one matrix unit the same length in both:

1. "one g-net per tile": the g-net as a diagram, an MLP from the binary codes of a position
   (row i, column j) inside a 64 x 64 tile (gbfunc standardises them), through 8 ReLU units,
   to the one weight w[i, j].
2. "tiles generated": the 3 x 4 grid of 64 x 64 tiles that covers the 150 x 200 weight of
   `nn.Linear(200, 150)`; the tiles' generated area (192 x 256) overhangs the matrix, and the
   overhang is hatched and labelled "cut".
3. "the p-net's weight": the 150 x 200 matrix the layer uses, the same values.

The values are the real ones: `gb.plan` / `gb.init(seed=0)` / `gb.apply`, and for the
overhang the raw tiles of the stack (checked to agree with `gb.apply` on the kept part).

Run from the repository root (CPU, a few seconds):

    python docs/figures/tiles.py [OUT.png]
"""

import io
import sys
from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Rectangle
from PIL import Image

import gbfunc as gb

OUT = Path(__file__).with_name("tiles.png")
SEED = 0
ROWS, COLS = 150, 200  # nn.Linear(200, 150).weight: rows = outputs, cols = inputs
TILE = (64, 64)
HIDDEN = 8
BITS = 6  # binary code width of a tile-local index 0..63
EXAMPLE = (37, 12)  # the position (i, j) whose code the g-net diagram shows
CMAP = "RdBu_r"  # diverging, colour-blind safe
DPI = 200  # the site shows the figure at 688 CSS px: sharp on 2x screens
# Inches: the site's 688 px column at 96 px per inch is 7.2 in; 7.15 because a PNG records whole
# pixels per metre, and 1440 px at 200 dpi would read back as 7.20001 in.
FIGSIZE = (7.15, 5.6)
# Faint, distinct outline colours of the 12 tiles (Okabe-Ito palette, repeated).
TILE_COLOURS = (
    "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00",
    "#CC79A7", "#999999", "#E69F00", "#56B4E9", "#009E73", "#0072B2",
)  # fmt: skip


def generate() -> tuple[np.ndarray, np.ndarray | None]:
    """The layer's `(150, 200)` weight and, where gbfunc's internals allow, the full
    `(192, 256)` generated area of its tiles (None otherwise)."""
    plan = gb.plan(torch.nn.Linear(COLS, ROWS), tile=TILE, hidden=HIDDEN)
    gparams = gb.init(plan, seed=SEED)
    with torch.no_grad():
        weight = gb.apply(gparams, plan)["weight"].numpy()
    try:  # the overhang is never materialised by gb.apply: evaluate the raw tiles
        from gbfunc.generate.torch_ops import evaluate_stack

        (stack,) = plan.stacks
        (param,) = [p for p in plan.params if p.name == "weight"]
        grid_r, grid_c = -(-ROWS // TILE[0]), -(-COLS // TILE[1])
        with torch.no_grad():
            tiles = evaluate_stack(stack, gparams["stacks"][stack.key]) * param.scale
        full = (
            tiles.reshape(grid_r, grid_c, *TILE)
            .permute(0, 2, 1, 3)
            .reshape(grid_r * TILE[0], grid_c * TILE[1])
            .numpy()
        )
        if not np.allclose(full[:ROWS, :COLS], weight, atol=1e-6):
            full = None
    except Exception:  # private API moved: show the kept part only
        full = None
    return weight, full


def draw_gnet(ax: Axes) -> tuple[float, float]:
    """The g-net: binary codes of (i, j) -> 8 ReLU units -> w[i, j], drawn in inches (the
    axes' data units, equal aspect: circles stay round). Returns the output unit's centre."""
    i, j = EXAMPLE
    bits = [int(b) for b in f"{i:0{BITS}b}"] + [int(b) for b in f"{j:0{BITS}b}"]
    x_in, x_hid, x_out = 1.0, 1.95, 2.85
    step, gap = 0.14, 0.07  # between input units; extra between the two codes
    y_in = 1.88 - step * np.arange(2 * BITS) - np.r_[np.zeros(BITS), np.full(BITS, gap)]
    y_mid = (y_in[0] + y_in[-1]) / 2
    y_hid = y_mid + 0.19 * (np.arange(HIDDEN)[::-1] - (HIDDEN - 1) / 2)
    y_out = y_mid
    for ya in y_in:
        for yb in y_hid:
            ax.plot([x_in, x_hid], [ya, yb], color="0.8", lw=0.5, zorder=1)
    for yb in y_hid:
        ax.plot([x_hid, x_out], [yb, y_out], color="0.6", lw=0.7, zorder=1)
    for ya, b in zip(y_in, bits, strict=True):
        ax.add_patch(
            Circle((x_in, ya), 0.045, fc="0.15" if b else "white", ec="0.15", lw=0.9, zorder=3)
        )
        ax.text(x_in - 0.08, ya, str(b), ha="right", va="center", fontsize=8, color="0.3")
    for yb in y_hid:
        ax.add_patch(Circle((x_hid, yb), 0.055, fc="#CFE3F3", ec="#0072B2", lw=1.1, zorder=3))
    ax.add_patch(Circle((x_out, y_out), 0.085, fc="#F4C9B3", ec="#D55E00", lw=1.4, zorder=3))
    # braces naming the two codes
    for lo, hi, name in ((y_in[BITS - 1], y_in[0], f"i = {i}"), (y_in[-1], y_in[BITS], f"j = {j}")):
        xb = x_in - 0.26
        ax.plot([xb, xb], [lo - 0.04, hi + 0.04], color="0.2", lw=1.2)
        ax.text(xb - 0.06, (lo + hi) / 2, name, ha="right", va="center", fontsize=9.5)
    ax.text(x_in - 0.2, 2.06, "code of (i, j)", ha="center", va="center", fontsize=9)
    ax.text(x_hid, 2.06, f"{HIDDEN} ReLU", ha="center", va="center", fontsize=9)
    ax.text(
        x_out, y_out + 0.2, "w[i, j]", ha="center", va="center", fontsize=10.5, fontweight="bold"
    )
    return x_out, y_out


def draw_tiles(ax: Axes, weight: np.ndarray, full: np.ndarray | None, vmax: float) -> None:
    """The generated area: the 3 x 4 tile grid over the weight, the overhang hatched."""
    grid_r, grid_c = -(-ROWS // TILE[0]), -(-COLS // TILE[1])
    height, width = grid_r * TILE[0], grid_c * TILE[1]
    shown = np.full((height, width), np.nan) if full is None else full.copy()
    shown[:ROWS, :COLS] = weight
    ax.imshow(
        shown,
        cmap=CMAP,
        vmin=-vmax,
        vmax=vmax,
        extent=(0, width, height, 0),
        interpolation="nearest",
    )
    # the overhang: greyed and hatched
    for x, y, w, h in ((COLS, 0, width - COLS, height), (0, ROWS, COLS, height - ROWS)):
        ax.add_patch(Rectangle((x, y), w, h, fc=(1, 1, 1, 0.72), ec="none", zorder=2))
        ax.add_patch(Rectangle((x, y), w, h, fc="none", ec="0.45", hatch="////", lw=0, zorder=3))
    label = dict(ha="center", va="center", fontsize=10, fontweight="bold", color="0.15", zorder=5)
    label["bbox"] = dict(boxstyle="round,pad=0.2", fc="white", ec="none")
    ax.text((COLS + width) / 2, ROWS / 2, "cut", rotation=90, **label)  # right of the weight
    ax.text(COLS / 2, (ROWS + height) / 2, "cut", **label)  # below it
    # the tiles, each outlined in its own faint colour, and labelled with its g-net
    for r in range(grid_r):
        for c in range(grid_c):
            k = r * grid_c + c
            x, y = c * TILE[1], r * TILE[0]
            ax.add_patch(
                Rectangle(
                    (x + 1.5, y + 1.5),
                    TILE[1] - 3,
                    TILE[0] - 3,
                    fc="none",
                    ec=TILE_COLOURS[k],
                    lw=2.2,
                    alpha=0.9,
                    zorder=4,
                )
            )
            ax.text(
                x + 5 if not x < COLS < x + 20 else COLS + 5,  # clear of the matrix's edge
                y + 5,
                f"g{k + 1}",
                ha="left",
                va="top",
                fontsize=8,
                zorder=6,
                bbox=dict(
                    boxstyle="round,pad=0.15", fc="white", ec=TILE_COLOURS[k], lw=1, alpha=0.9
                ),
            )
    # the matrix's edge
    ax.add_patch(Rectangle((0, 0), COLS, ROWS, fc="none", ec="black", lw=1.6, zorder=7))
    ax.set_xticks([0, 64, 128, COLS])
    ax.set_yticks([0, 64, 128, ROWS])
    ax.tick_params(labelsize=8, length=3, top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    for s in ax.spines.values():
        s.set_color("0.6")
    ax.text(
        width / 2,
        height + 10,
        f"{grid_r} × {grid_c} tiles of {TILE[0]} × {TILE[1]}: "
        f"{height} × {width} generated\n"
        "rows = outputs, columns = inputs",
        ha="center",
        va="top",
        fontsize=8.5,
        color="0.25",
    )


def draw_weight(fig: Figure, ax: Axes, weight: np.ndarray, vmax: float) -> None:
    """The layer's weight, the same values, with a small colour bar."""
    im = ax.imshow(
        weight, cmap=CMAP, vmin=-vmax, vmax=vmax, extent=(0, COLS, ROWS, 0), interpolation="nearest"
    )
    ax.set_xticks([0, 100, COLS])
    ax.set_yticks([0, 75, ROWS])
    ax.tick_params(labelsize=8, length=3, top=True, labeltop=True, bottom=False, labelbottom=False)
    for s in ax.spines.values():
        s.set_color("black")
        s.set_linewidth(1.6)
    pos = ax.get_position()
    cax = fig.add_axes((pos.x1 + 0.008, pos.y0, 0.009, pos.height))
    cb = fig.colorbar(im, cax=cax)
    cb.ax.tick_params(labelsize=8, length=2)
    cb.outline.set_linewidth(0.5)


def arrow(fig: Figure, start: tuple[float, float], end: tuple[float, float]) -> None:
    """An arrow between two panels, in inches from the figure's bottom left."""
    fig.patches.append(
        FancyArrowPatch(
            start,
            end,
            transform=fig.dpi_scale_trans,
            arrowstyle="-|>",
            mutation_scale=16,
            lw=1.8,
            color="0.25",
            shrinkA=0,
            shrinkB=0,
        )
    )


def main(out: Path = OUT) -> None:
    """Generate the weights, draw the three panels and write them to `out`.

    Layout, in inches (the figure is 7.15 in wide: the documentation shows it at 688 CSS px,
    so its point sizes read at their nominal size): the g-net on top with its caption beside
    it; below, the tiles generated and, right of them, the p-net's weight."""
    torch.manual_seed(SEED)
    weight, full = generate()
    vmax = float(np.abs(full if full is not None else weight).max())

    fig = Figure(figsize=FIGSIZE, dpi=DPI, facecolor="white")  # no pyplot: no GUI backend
    fig_w, fig_h = FIGSIZE

    def place(x: float, y: float, w: float, h: float) -> Axes:
        return fig.add_axes((x / fig_w, y / fig_h, w / fig_w, h / fig_h))

    def text(x: float, y: float, s: str, **kw) -> None:
        fig.text(x, y, s, transform=fig.dpi_scale_trans, **kw)

    title = dict(fontsize=12, fontweight="bold", ha="center", va="bottom")
    note = dict(fontsize=9, color="0.25")
    # One matrix unit is the same length in both matrix panels.
    unit = 2.2 / 192  # inches per row / column
    grid_w, grid_h = 256 * unit, 192 * unit
    x_mid, y_low = 0.4, 0.5  # panel 2's bottom left
    top_low = y_low + grid_h  # the matrix panels' top edge
    x_right = x_mid + grid_w + 0.85
    # 1. the g-net, drawn in inches, on top
    gnet_x, gnet_y, gnet_w, gnet_h = 0.1, top_low + 0.45, 3.1, 2.2
    ax_g = place(gnet_x, gnet_y, gnet_w, gnet_h)
    ax_g.set_xlim(0, gnet_w)
    ax_g.set_ylim(0, gnet_h)
    ax_g.set_aspect("equal")
    ax_g.axis("off")
    out_x, out_y = draw_gnet(ax_g)
    out_x, out_y = gnet_x + out_x, gnet_y + out_y
    text(gnet_x + 1.45, gnet_y + gnet_h, "1. one g-net per tile", **title)
    n_params = 2 * BITS * HIDDEN + HIDDEN + HIDDEN + 1
    text(
        out_x + 0.55,
        out_y,
        f"{n_params} parameters per g-net: the binary\n"
        f"code of a position (i, j) in its tile in,\n"
        f"that position's weight out. It runs on\n"
        f"all {TILE[0]} × {TILE[1]} positions of its tile.",
        ha="left",
        va="center",
        linespacing=1.4,
        **note,
    )
    # 2. the tiles generated, below left
    ax_t = place(x_mid, y_low, grid_w, grid_h)
    draw_tiles(ax_t, weight, full, vmax)
    text(x_mid + grid_w / 2, top_low + 0.27, "2. tiles generated", **title)
    # 3. the p-net's weight, below right, top-aligned with the tiles
    right_w, right_h = COLS * unit, ROWS * unit
    ax_w = place(x_right, top_low - right_h, right_w, right_h)
    draw_weight(fig, ax_w, weight, vmax)
    text(x_right + right_w / 2, top_low + 0.27, "3. the p-net's weight", **title)
    text(
        x_right + right_w / 2,
        top_low - right_h - 0.1,
        f"{ROWS} × {COLS}: stitched and cut to the\nlayer's shape; only the g-nets "
        "are\ntrained and stored",
        ha="center",
        va="top",
        **note,
    )
    # the arrows: g-net -> its 12 tiles; tiles -> the weight
    arrow(fig, (out_x, out_y - 0.1), (out_x, top_low + 0.05))
    text(out_x + 0.12, (out_y + top_low) / 2, "× 12 tiles", ha="left", va="center", **note)
    y_mid = top_low - grid_h / 2
    arrow(fig, (x_mid + grid_w + 0.08, y_mid), (x_right - 0.38, y_mid))
    text(
        (x_mid + grid_w + x_right - 0.3) / 2,
        y_mid + 0.1,
        "stitch\n+ cut",
        ha="center",
        va="bottom",
        **note,
    )

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white")
    # A 192-colour palette, no dithering: the noisy weight images make a full RGB PNG ~350 kB.
    image = Image.open(buf).convert("RGB")
    image.quantize(colors=192, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
        out, optimize=True, dpi=(DPI, DPI)
    )
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
