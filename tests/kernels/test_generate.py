"""The fused g-net kernels against their references: outputs, every gradient, vmap, errors.

Off the GPU the kernels run through Triton's interpreter (tests/conftest.py), so shapes stay
tiny. References run in float64; the kernels in the dtype under test, compared through a
per-dtype tolerance table whose absolute part grows with the length of the reduction.
"""

import math
from dataclasses import dataclass

import pytest
import torch
from devices import KERNEL_DEVICE
from hypothesis import given, settings, strategies as st
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import gbfunc as gb
from gbfunc import kernels
from gbfunc._tiling import assemble
from gbfunc.kernels import Terms, _placement, _runtime, stack_terms
from gbfunc.kernels.generate import kernel as forward_kernel, reference as forward_reference
from gbfunc.kernels.generate_backward import (
    kernel as backward_kernel,
    reference as backward_reference,
)

NAMES = Terms._fields
GRAD_NAMES = tuple(f"grad_{n}" for n in NAMES)

# (rtol, atol per sqrt(reduction length)), relative to the largest expected magnitude.
TOLERANCE = {
    torch.float32: (1e-5, 2e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (compiled Triton kernels)"
)


class OpsSeen(TorchDispatchMode):
    """Records the name of every op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


class ColumnSplit(nn.Module):
    """Three matrices side by side on columns (like GPT-2's fused `c_attn`), tiled separately."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(rows, 3 * cols))  # the rule's std


gb.register_rule(ColumnSplit, lambda m: {"weight": gb.Layout(0.02, splits=3, split_dim=1)})


@dataclass(frozen=True)
class Case:
    """A tiny p-net layer and g-net genome; `stack` is the first stack of its plan."""

    layer: str
    size: tuple[int, int]
    window: int
    tile: tuple[int, int]
    hidden: int
    depth: int
    activation: str
    outputs: int
    window_in: str
    seed: int

    def model(self) -> nn.Module:
        out, inp = self.size
        if self.layer == "linear":
            return nn.Linear(inp, out)
        if self.layer == "pair":  # two parameters in one stack
            return nn.Sequential(nn.Linear(inp, out), nn.Linear(inp, out))
        if self.layer == "conv1d":
            return nn.Conv1d(inp, out, self.window)
        if self.layer == "conv2d":
            return nn.Conv2d(inp, out, (self.window, 2))
        if self.layer == "attention":  # in_proj split in three row blocks
            return nn.MultiheadAttention(out, 1)
        return ColumnSplit(out, inp)

    def plan(self) -> gb.Plan:
        opts = {"hidden": self.hidden, "depth": self.depth, "activation": self.activation}
        return gb.plan(
            self.model(), tile=self.tile, outputs=self.outputs, window_in=self.window_in, **opts
        )

    def stack(self) -> tuple[gb.Stack, tuple[gb.Generated, ...], gb.Plan]:
        plan = self.plan()
        return plan.stacks[0], tuple(p for p in plan.generated if p.stack_index == 0), plan

    def terms(self, dtype: torch.dtype, genomes: int = 0) -> dict[str, Tensor | None]:
        """The first stack's g-net terms from perturbed `gb.init` leaves (biases made nonzero)."""
        stack, _, plan = self.stack()
        gen = torch.Generator().manual_seed(self.seed)
        leaves = gb.init(plan, seed=self.seed, dtype=torch.float64)["stacks"][stack.key]

        def draw() -> dict[str, Tensor | None]:
            noisy = {
                k: v.detach() + 0.2 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
                for k, v in leaves.items()
            }
            return dict(zip(NAMES, stack_terms(stack, noisy), strict=True))

        draws = [draw() for _ in range(max(genomes, 1))]
        stacked = {
            n: None if draws[0][n] is None else torch.stack([d[n] for d in draws]) for n in NAMES
        }
        return {
            n: None if x is None else (x if genomes else x[0]).to(KERNEL_DEVICE, dtype).contiguous()
            for n, x in stacked.items()
        }


@st.composite
def cases(draw) -> Case:
    """A layer covered by a 1-3 x 1-3 grid of tiles, ragged at its far edges."""
    layer = draw(st.sampled_from(["linear", "pair", "conv1d", "conv2d", "attention", "columns"]))
    conv = layer.startswith("conv")
    tile = (draw(st.sampled_from([1, 2, 3, 4, 8])), draw(st.sampled_from([1, 2, 3, 4, 5])))
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    size = (
        draw(st.integers((rows - 1) * tile[0] + 1, rows * tile[0])),
        draw(st.integers((cols - 1) * tile[1] + 1, cols * tile[1])),
    )
    if layer == "attention":  # (3E, E) in three blocks, plus out_proj: keep E small
        size = (min(size[0], 6), size[1])
    # A row of evaluations never outgrows the (clipped) tile: gb.plan refuses that.
    cols = size[0] if layer == "attention" else size[1]  # attention's blocks are (E, E)
    widths = [o for o in (1, 1, 2, 3) if o <= min(tile[1], cols)]
    return Case(
        layer=layer,
        size=size,
        window=draw(st.integers(1, 3)),
        tile=tile,
        hidden=draw(st.sampled_from([1, 3, 8, 17])),
        depth=draw(st.integers(1, 3)),
        activation=draw(st.sampled_from(["relu", "gelu", "tanh", "silu"])),
        outputs=1 if conv else draw(st.sampled_from(widths)),
        window_in=draw(st.sampled_from(["code", "output"])) if conv else "code",
        seed=draw(st.integers(0, 2**16)),
    )


def assert_close(actual: Tensor | None, expected: Tensor | None, reduction: int, name: str) -> None:
    """Compare with the dtype's tolerance; `reduction`: length of the longest sum behind a value."""
    assert (actual is None) == (expected is None), name
    if actual is None:
        return
    rtol, atol = TOLERANCE[actual.dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        rtol=rtol,
        atol=atol * math.sqrt(reduction) * scale,
        msg=lambda m: f"{name}: {m}",
    )


def reductions(stack: gb.Stack) -> tuple[int, int]:
    """Longest sums behind an output (hidden units, layers) and a gradient (positions too)."""
    forward = stack.genome.hidden * stack.genome.depth
    return forward, forward * stack.tile[0] * stack.columns * max(1, stack.outputs)


def as64(terms: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    return {n: None if x is None else x.double() for n, x in terms.items()}


def weighted_sum(fn, stack: gb.Stack, params: tuple, absent: dict, cotangent: Tensor):
    """`terms -> sum(fn(terms) * cotangent)`: its gradient is the op's vector-Jacobian product.

    `fn` is the kernel op or its reference; `absent` holds the `None` terms (`split`).
    """
    return lambda t: (fn(Terms(**t, **absent), stack, params) * cotangent).sum()


def split(terms: dict[str, Tensor | None]) -> tuple[dict[str, Tensor], dict[str, None]]:
    """Tensors to differentiate, and the `None` hidden layers of a one-layer g-net, apart."""
    return {n: x for n, x in terms.items() if x is not None}, {
        n: None for n, x in terms.items() if x is None
    }


@given(cases())
def test_forward_kernel_matches_reference(case):
    stack, params, _ = case.stack()
    terms = case.terms(torch.float32)
    out = forward_kernel.generate(Terms(**terms), stack, params)
    expected = forward_reference.generate(Terms(**as64(terms)), stack, params)
    assert out.shape == (sum(p.numel for p in params),)
    assert_close(out, expected, reductions(stack)[0], "out")


def cotangent_of(case, params) -> torch.Tensor:
    """A random gradient of the generated weights, flat, from the case's seed."""
    generator = torch.Generator().manual_seed(case.seed)
    return torch.randn(sum(p.numel for p in params), generator=generator).to(KERNEL_DEVICE)


@given(cases())
def test_backward_kernel_matches_reference(case):
    stack, params, _ = case.stack()
    terms = case.terms(torch.float32)
    cotangent = cotangent_of(case, params)
    grads = backward_kernel.generate_backward(cotangent, Terms(**terms), stack, params)
    expected = backward_reference.generate_backward(
        cotangent.double(), Terms(**as64(terms)), stack, params
    )
    for name, g, e in zip(GRAD_NAMES, grads, expected, strict=True):
        assert_close(g, e, reductions(stack)[1], name)


def test_the_backward_kernel_starts_its_own_sums(monkeypatch):
    # The launcher allocates the partials uninitialised; NaN there must never reach a gradient.
    # Depth 2 (hidden partials too) and rows split over several programs, some without rows.
    case = Case("linear", (13, 11), 1, (8, 4), 6, 2, "tanh", 1, "code", 3)
    stack, params, _ = case.stack()
    terms = case.terms(torch.float32)
    cotangent = torch.randn(sum(p.numel for p in params)).to(KERNEL_DEVICE)
    empty = torch.empty

    def poisoned(*args, **kwargs) -> Tensor:
        out = empty(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    grads = backward_kernel.generate_backward(cotangent, Terms(**terms), stack, params)
    monkeypatch.undo()
    assert backward_kernel.splits_for(KERNEL_DEVICE, stack.num_tiles, stack.tile[0]) > 1
    expected = backward_reference.generate_backward(
        cotangent.double(), Terms(**as64(terms)), stack, params
    )
    for name, g, e in zip(GRAD_NAMES, grads, expected, strict=True):
        assert_close(g, e, reductions(stack)[1], name)


@given(cases())
def test_grad_of_op_matches_grad_of_reference(case):
    stack, params, _ = case.stack()
    terms = case.terms(torch.float32)
    cotangent = cotangent_of(case, params)
    tensors, absent = split(terms)

    got = grad(weighted_sum(kernels.generate, stack, params, absent, cotangent))(tensors)
    expected = grad(
        weighted_sum(forward_reference.generate, stack, params, absent, cotangent.double())
    )(as64(tensors))
    assert set(got) == set(tensors)
    for name in tensors:
        assert_close(got[name], expected[name], reductions(stack)[1], f"grad_{name}")


@settings(max_examples=6)
@given(cases(), st.integers(2, 3))
def test_vmap_over_genomes_is_a_loop(case, genomes):
    stack, params, _ = case.stack()
    terms, absent = split(case.terms(torch.float32, genomes))
    terms["c"] = terms["c"][0]  # one input left unbatched: vmap broadcasts it
    in_dims = {n: None if n == "c" else 0 for n in terms}
    cotangent = torch.randn(genomes, sum(p.numel for p in params), device=KERNEL_DEVICE)

    def op(t):
        return kernels.generate(Terms(**t, **absent), stack, params)

    def loss(t, cot):
        return (op(t) * cot).sum()

    out = vmap(op, in_dims=(in_dims,))(terms)
    grads = vmap(grad(loss), in_dims=(in_dims, 0))(terms, cotangent)
    for k in range(genomes):
        one = {n: x if in_dims[n] is None else x[k] for n, x in terms.items()}
        torch.testing.assert_close(out[k], op(one), rtol=0, atol=0)
        loop = grad(loss)(one, cotangent[k])
        for name in terms:
            torch.testing.assert_close(grads[name][k], loop[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_kernels_run_as_the_ops_the_compiler_sees():
    """The forward and the backward reach the kernels through the `torch.library.triton_op`
    ops `gbfunc::generate` and `gbfunc::generate_backward` (what inductor traces), and the ops
    give the launchers' own numbers."""
    case = Case("linear", (6, 5), 1, (4, 4), 5, 2, "tanh", 1, "code", 11)
    stack, params, _ = case.stack()
    tensors, absent = split(case.terms(torch.float32))
    cotangent = cotangent_of(case, params)
    loss = weighted_sum(kernels.generate, stack, params, absent, cotangent)
    terms = Terms(**tensors, **absent)
    with OpsSeen() as seen:
        out = kernels.generate(terms, stack, params)
        grads = grad(loss)(tensors)
    assert {"gbfunc.generate.default", "gbfunc.generate_backward.default"} <= seen.names
    torch.testing.assert_close(out, forward_kernel.generate(terms, stack, params), rtol=0, atol=0)
    launched = backward_kernel.generate_backward(cotangent, terms, stack, params)
    for name, g in grads.items():
        torch.testing.assert_close(g, getattr(launched, name), msg=name)


def test_nested_vmap_and_second_order():
    case = Case("attention", (4, 4), 1, (3, 2), 5, 2, "gelu", 1, "code", 7)
    stack, params, _ = case.stack()
    terms = case.terms(torch.float32, genomes=2)
    nested = vmap(vmap(lambda t: kernels.generate(Terms(**t), stack, params)))
    twice = {
        n: None if x is None else torch.stack([x, 2 * x]) for n, x in terms.items()
    }  # (2, 2, ...)
    expected = forward_reference.generate(Terms(**as64(twice)), stack, params)
    assert_close(nested(twice), expected, reductions(stack)[0], "nested vmap")

    one = {n: x[0] for n, x in terms.items()}  # depth 2: every term is a tensor

    def second(fn, t):
        def loss(u):
            return (fn(Terms(**u), stack, params) ** 2).sum()

        return sum((g**2).sum() for g in grad(loss)(t).values())

    got = grad(lambda t: second(kernels.generate, t))(one)
    want = grad(lambda t: second(forward_reference.generate, t))(as64(one))
    for name in NAMES:
        assert_close(got[name], want[name], 10 * reductions(stack)[1], f"second-order {name}")


def test_second_order_of_a_one_layer_gnet():
    # No hidden-to-hidden terms: the backward op has `None` gradients among its outputs.
    case = Case("linear", (5, 6), 1, (4, 4), 3, 1, "tanh", 2, "code", 0)
    stack, params, _ = case.stack()
    tensors, absent = split(case.terms(torch.float32))

    def second(fn, t):
        def loss(u):
            return (fn(Terms(**u, **absent), stack, params) ** 2).sum()

        return sum((g**2).sum() for g in grad(loss)(t).values())

    got = grad(lambda t: second(kernels.generate, t))(tensors)
    want = grad(lambda t: second(forward_reference.generate, t))(as64(tensors))
    assert set(got) == {"a", "b", "c", "w_out", "b_out"}
    for name in got:
        assert_close(got[name], want[name], 10 * reductions(stack)[1], f"second-order {name}")


def test_half_precision():
    case = Case("conv2d", (3, 5), 3, (4, 2), 8, 2, "silu", 1, "output", 3)
    stack, params, _ = case.stack()
    terms = case.terms(torch.float16)
    out = kernels.generate(Terms(**terms), stack, params)
    assert out.dtype == torch.float16
    assert_close(
        out, forward_reference.generate(Terms(**as64(terms)), stack, params), 16, "fp16 out"
    )
    grads = grad(lambda t: kernels.generate(Terms(**t), stack, params).float().sum())(terms)
    expected = grad(lambda t: forward_reference.generate(Terms(**t), stack, params).sum())(
        as64(terms)
    )
    for name in NAMES:  # depth 2: every term is a tensor
        assert_close(grads[name], expected[name], reductions(stack)[1], f"fp16 grad_{name}")


@settings(max_examples=30)
@given(cases())
def test_placement_is_assemble(case):
    # Tiles holding their own position index, assembled by gbfunc, must land where the table says.
    stack, params, _ = case.stack()
    places, scales, numel = _placement.placement(stack, params)
    th, width = stack.tile[0], stack.columns * stack.outputs
    tiles = torch.arange(stack.num_tiles * th * width, dtype=torch.float64).reshape(
        stack.num_tiles, th, width
    )
    flat = torch.cat([(assemble(p, stack, tiles) / p.scale).reshape(-1) for p in params])
    expected = torch.full((numel,), -1.0, dtype=torch.float64)
    for t, ((base, ld, rows, cols), scale) in enumerate(zip(places, scales, strict=True)):
        assert scale == next(
            p.scale
            for p in params
            if any(b.first_tile <= t < b.first_tile + b.num_tiles for b in p.blocks)
        )
        i, j = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        expected[base + i * ld + j] = tiles[t, i, j]
    torch.testing.assert_close(flat.round(), expected, rtol=0, atol=0)


class TestErrors:
    case = Case("linear", (5, 6), 1, (4, 4), 4, 2, "relu", 1, "code", 0)

    def call(self, **changes):
        stack, params, _ = self.case.stack()
        terms = {**self.case.terms(torch.float32), **changes}
        return forward_kernel.generate(Terms(**terms), stack, params)

    def test_dtype_mismatch_names_the_argument(self):
        with pytest.raises(
            TypeError, match=r"w_out has dtype torch.float64; expected torch.float32, like a"
        ):
            self.call(w_out=self.case.terms(torch.float64)["w_out"])

    def test_unsupported_dtype(self):
        with pytest.raises(TypeError, match=r"a has dtype torch.float64; the kernels take float32"):
            self.call(**self.case.terms(torch.float64))

    def test_device_mismatch_names_the_argument(self):
        first = self.case.terms(torch.float32)["a"].device
        with pytest.raises(ValueError, match=rf"b_hidden is on meta; expected {first}, like a"):
            self.call(b_hidden=self.case.terms(torch.float32)["b_hidden"].to("meta"))

    def test_non_contiguous_is_rejected_by_the_launcher_and_copied_by_the_op(self):
        stack, params, _ = self.case.stack()
        terms = self.case.terms(torch.float32)
        strided = {**terms, "b": terms["b"].transpose(-1, -2).contiguous().transpose(-1, -2)}
        with pytest.raises(ValueError, match=r"kernels.generate: b is not contiguous"):
            forward_kernel.generate(Terms(**strided), stack, params)
        torch.testing.assert_close(
            kernels.generate(Terms(**strided), stack, params),
            kernels.generate(Terms(**terms), stack, params),
        )

    def test_shape_from_another_stack(self):
        with pytest.raises(
            ValueError, match=r"a has shape \(2, 4, 4\); expected \(4, 4, 4\) for stack 's0_4x4'"
        ):
            self.call(a=torch.zeros(2, 4, 4, device=KERNEL_DEVICE))

    def test_missing_hidden_layers(self):
        with pytest.raises(
            ValueError, match=r"w_hidden must be a Tensor of shape \(4, 1, 4, 4\) for depth 2"
        ):
            self.call(w_hidden=None)

    def test_hidden_too_wide_for_the_kernel(self):
        wide = Case("linear", (2, 2), 1, (2, 2), 300, 1, "relu", 1, "code", 0)
        stack, params, _ = wide.stack()
        with pytest.raises(
            ValueError, match=r"has genome.hidden=300 > 256 \(.*\)\. Use backend='torch'"
        ):
            forward_kernel.generate(Terms(**wide.terms(torch.float32)), stack, params)

    def test_params_of_another_stack(self):
        stack, _, _ = self.case.stack()
        with pytest.raises(ValueError, match=r"params \[\] do not tile stack 's0_4x4' \(4 tiles\)"):
            forward_kernel.generate(Terms(**self.case.terms(torch.float32)), stack, ())

    def test_not_a_stack(self):
        _, params, _ = self.case.stack()
        with pytest.raises(TypeError, match=r"stack must be a gb.Stack"):
            backward_kernel.generate_backward(
                torch.zeros(30, device=KERNEL_DEVICE),
                Terms(*[None] * len(NAMES)),
                "s0",
                params,
            )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_dtypes_match_reference(dtype):
    case = Case("conv2d", (24, 40), 3, (16, 8), 32, 2, "gelu", 1, "code", 0)
    stack, params, _ = case.stack()
    terms = {n: None if x is None else x.cuda() for n, x in case.terms(dtype).items()}
    out = kernels.generate(Terms(**terms), stack, params)
    assert_close(out, forward_reference.generate(Terms(**as64(terms)), stack, params), 64, "out")
    expected = grad(lambda t: forward_reference.generate(Terms(**t), stack, params).sum())(
        as64(terms)
    )
    grads = grad(lambda t: kernels.generate(Terms(**t), stack, params).float().sum())(terms)
    for name in NAMES:
        assert_close(grads[name], expected[name], reductions(stack)[1], f"grad_{name}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "case",
    [
        Case("linear", (70, 90), 1, (16, 24), 32, 2, "gelu", 3, "code", 0),  # dots, ragged
        Case("conv2d", (20, 12), 3, (8, 8), 32, 1, "silu", 1, "code", 1),  # row reductions
    ],
    ids=["three-outputs-depth-2", "one-output"],
)
def test_gpu_every_autotune_config_matches_reference(case, all_autotune_configs, monkeypatch):
    # The tuner may pick any config for a shape: each must compute the same op.
    stack, params, _ = case.stack()
    tensors, absent = split(case.terms(torch.float32))
    out = forward_reference.generate(Terms(**as64(tensors), **absent), stack, params)
    cotangent = torch.randn(out.shape, dtype=torch.float64, device=out.device)

    expected = grad(weighted_sum(forward_reference.generate, stack, params, absent, cotangent))(
        as64(tensors)
    )
    forward, backward = (k.configs for k in all_autotune_configs)
    for step in range(max(len(forward), len(backward))):
        configs = (forward[step % len(forward)], backward[step % len(backward)])
        for kernel, config in zip(all_autotune_configs, configs, strict=True):
            monkeypatch.setattr(kernel, "configs", [config])
        label = " / ".join(str(c) for c in configs)
        got = kernels.generate(Terms(**tensors, **absent), stack, params)
        assert_close(got, out, reductions(stack)[0], label)
        grads = grad(weighted_sum(kernels.generate, stack, params, absent, cotangent.float()))(
            tensors
        )
        for name in tensors:
            assert_close(grads[name], expected[name], reductions(stack)[1], f"{label}: grad_{name}")


@pytest.mark.gpu
@requires_gpu
def test_gpu_autotune_sweep_picks_a_config_per_shape(all_autotune_configs):
    # Each new shape is tuned over every config, forward and backward (the tuner reruns the
    # backward on the same buffers, with None hidden partials at depth 1), and still matches.
    tuned_before = [len(kernel.cache) for kernel in all_autotune_configs]
    shapes = [((64, 64), 32, 1, 1), ((32, 64), 64, 2, 1), ((16, 48), 16, 3, 4)]
    for tile, hidden, depth, outputs in shapes:
        case = Case("linear", (200, 300), 1, tile, hidden, depth, "relu", outputs, "code", 0)
        stack, params, _ = case.stack()
        tensors, absent = split(case.terms(torch.float32))
        cotangent = torch.randn(sum(p.numel for p in params), device=KERNEL_DEVICE)

        out = kernels.generate(Terms(**tensors, **absent), stack, params)
        expected = forward_reference.generate(Terms(**as64(tensors), **absent), stack, params)
        assert_close(out, expected, reductions(stack)[0], str(tile))
        got = grad(weighted_sum(kernels.generate, stack, params, absent, cotangent))(tensors)
        want = grad(
            weighted_sum(forward_reference.generate, stack, params, absent, cotangent.double())
        )(as64(tensors))
        for name in tensors:
            assert_close(got[name], want[name], reductions(stack)[1], f"{tile}: grad_{name}")
    tuned = [
        len(kernel.cache) - n for kernel, n in zip(all_autotune_configs, tuned_before, strict=True)
    ]
    assert tuned == [len(shapes), len(shapes)]  # one tuning per new shape, in both kernels


@pytest.mark.slow
def test_dot_precision_traces_under_compile_and_follows_the_setting():
    # Read inside the fused op when `torch.compile(fullgraph=True)` traces it on a GPU.
    def signed(x: Tensor) -> Tensor:
        return x + (1.0 if _runtime.dot_precision(torch.float32) == "ieee" else -1.0)

    compiled = torch.compile(signed, fullgraph=True)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compiled(torch.zeros(2)).tolist() == [1.0, 1.0]
        torch.set_float32_matmul_precision("high")
        assert compiled(torch.zeros(2)).tolist() == [-1.0, -1.0]
    finally:
        torch.set_float32_matmul_precision(before)
    assert _runtime.dot_precision(torch.bfloat16) == "tf32"
