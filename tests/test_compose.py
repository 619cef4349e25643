"""gb.apply composes with torch.func.grad, vmap and torch.compile(fullgraph=True)."""

import re
import warnings

import pytest
import torch
from naive import naive_apply
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.utils._pytree import tree_leaves, tree_map

import gbfunc as gb

GENOMES = {
    "default": {"tile": (4, 4)},
    "deep-gelu": {"tile": (4, 3), "depth": 2, "activation": "gelu", "hidden": 6},
    "shared-fourier": {"tile": (3, 4), "share": True, "encoding": "fourier", "hidden": 8},
    "outputs": {"tile": (4, 4), "outputs": 2, "hidden": 8, "activation": "tanh"},
    "conv-output": {"tile": (2, 2), "window_in": "output", "hidden": 8},
    "conv-hashed": {"tile": (2, 3), "hashed": 5, "hidden": 6},
}


def tiny_model(conv: bool) -> nn.Module:
    if conv:
        return nn.Sequential(nn.Conv2d(3, 5, 2), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 3 * 3, 4))
    return nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def loss_fn(model, plan, apply=gb.apply):
    def loss(gparams, x, y):
        out = functional_call(model, apply(gparams, plan), (x,))
        return nn.functional.cross_entropy(out, y)

    return loss


def batch(conv: bool, n: int = 5, dtype=torch.float64):
    x = torch.randn(n, 3, 4, 4, dtype=dtype) if conv else torch.randn(n, 7, dtype=dtype)
    return x, torch.randint(0, 4 if conv else 3, (n,))


def float64_setup(genome: str) -> tuple[nn.Module, gb.Plan, dict, tuple]:
    """The tiny model of `genome`, its plan, float64 g-nets and a batch."""
    conv = genome.startswith("conv")
    model = tiny_model(conv).double()
    plan = gb.plan(model, **GENOMES[genome])
    return model, plan, gb.init(plan, dtype=torch.float64), batch(conv)


@pytest.mark.parametrize("genome", list(GENOMES))
def test_grad_matches_finite_differences(genome):
    model, plan, gparams, (x, y) = float64_setup(genome)
    leaves, spec = torch.utils._pytree.tree_flatten(gparams)
    loss = loss_fn(model, plan)

    def flat_loss(*flat):
        return loss(torch.utils._pytree.tree_unflatten(list(flat), spec), x, y)

    inputs = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
    assert torch.autograd.gradcheck(
        flat_loss, inputs, eps=1e-6, atol=1e-6, fast_mode=True, check_forward_ad=True
    )  # forward mode too: the tile MLP's jvp (it had none: jvp, jacfwd, hessian raised)


def test_the_hessian_by_forward_over_reverse_equals_reverse_over_reverse():
    model, plan, gparams, (x, y) = float64_setup("deep-gelu")
    loss = loss_fn(model, plan)
    forward = torch.func.hessian(loss)(gparams, x, y)
    reverse = torch.func.jacrev(torch.func.jacrev(loss))(gparams, x, y)
    for a, b in zip(tree_leaves(forward), tree_leaves(reverse), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("genome", list(GENOMES))
def test_grad_matches_the_unstacked_reference(genome):
    model, plan, gparams, (x, y) = float64_setup(genome)
    fast = grad(loss_fn(model, plan))(gparams, x, y)
    slow = grad(loss_fn(model, plan, naive_apply))(gparams, x, y)
    for a, b in zip(tree_leaves(fast), tree_leaves(slow), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def stack_genomes(plan, seeds, dtype=torch.float32):
    trees = [gb.init(plan, seed=s, dtype=dtype) for s in seeds]
    return trees, tree_map(lambda *xs: torch.stack(xs), *trees)


@pytest.mark.parametrize("genome", list(GENOMES))
def test_vmap_over_genomes_equals_the_loop(genome):
    conv = genome.startswith("conv")
    model = tiny_model(conv)
    plan = gb.plan(model, **GENOMES[genome])
    trees, stacked = stack_genomes(plan, range(3))
    out = vmap(gb.apply, in_dims=(0, None))(stacked, plan)
    for name, value in out.items():
        loop = torch.stack([gb.apply(t, plan)[name] for t in trees])
        torch.testing.assert_close(value, loop, rtol=1e-6, atol=1e-7, msg=name)
    # Population training: per-genome gradients in one call.
    x, y = batch(conv, dtype=torch.float32)
    loss = loss_fn(model, plan)
    grads = vmap(grad(loss), in_dims=(0, None, None))(stacked, x, y)
    for k, tree in enumerate(trees):
        one = grad(loss)(tree, x, y)
        for a, b in zip(tree_leaves(grads), tree_leaves(one), strict=True):
            torch.testing.assert_close(a[k], b, rtol=1e-5, atol=1e-6)


def test_check_under_vmap_says_to_check_before_it():
    plan = gb.plan(tiny_model(False), tile=(4, 4))
    _, stacked = stack_genomes(plan, range(2))
    with pytest.raises(RuntimeError, match=r"gb.apply: check=True reads the leaves' values, wh"):
        vmap(lambda g: gb.apply(g, plan, check=True))(stacked)


@pytest.mark.slow
# Dynamo's tracing under vmap reads `.grad` of a non-leaf while wrapping it (torch 2.13).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_vmap_over_genomes_equals_eager_vmap():
    """Many genomes generated at once, compiled whole: `torch.compile(vmap(gb.apply))`, with
    several outputs, two layers and a hashed table. (Dynamo inlines the tile MLP's Function
    when no input requires grad; with a `*inputs` forward it passed `ctx` as an input.)"""
    model = tiny_model(conv=False)
    plan = gb.plan(model, tile=(4, 4), outputs=2, depth=2, hidden=6, hashed=5)
    _, stacked = stack_genomes(plan, range(3))
    generate = vmap(gb.apply, in_dims=(0, None))
    compiled = torch.compile(generate, fullgraph=True)(stacked, plan)
    for name, value in generate(stacked, plan).items():
        torch.testing.assert_close(compiled[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_grad_of_a_vmapped_ensemble_equals_eager():
    """`torch.compile(grad(vmap(loss)))`: the loops' ops failed traced under both transforms
    ("must override the setup_context staticmethod", torch 2.13), where the loops are built;
    the `cpu-loops` path refuses traced calls inside nested transforms."""
    model = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))
    plan = gb.plan(model, tile=(4, 4))
    stacked = tree_map(lambda t: t.detach(), stack_genomes(plan, range(3))[1])
    x, y = torch.randn(5, 12), torch.randint(0, 3, (5,))
    loss = loss_fn(model, plan)
    ensemble = grad(lambda g: vmap(loss, in_dims=(0, None, None))(g, x, y).sum())
    eager = ensemble(stacked)
    compiled = torch.compile(ensemble, fullgraph=True)(stacked)
    for a, b in zip(tree_leaves(compiled), tree_leaves(eager), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_transforms_dynamo_traces_no_custom_function_under_are_told_apart():
    """`Context.plain`'s test: one `grad` level, `vmap`s, or `vmap`s inside one `grad` are
    fine; two reverse-mode levels, a forward-mode one, or a `grad` inside a `vmap` are not."""
    from torch.func import jvp

    from gbfunc._tracing import functions_traceable

    seen = {}

    def probe(name):
        def f(x):
            seen[name] = functions_traceable()
            return x.sum()

        return f

    x = torch.ones(2, 3)
    probe("none")(x)
    grad(probe("grad"))(x)
    vmap(probe("vmap"))(x)
    grad(lambda x: vmap(probe("grad of vmap"))(x).sum())(x)
    grad(lambda x: grad(probe("grad of grad"))(x).sum())(x)
    jvp(probe("jvp"), (x,), (x,))
    vmap(grad(probe("vmap of grad")))(x)
    assert seen == {
        "none": True,
        "grad": True,
        "vmap": True,
        "grad of vmap": True,
        "grad of grad": False,
        "jvp": False,
        "vmap of grad": False,
    }


@pytest.mark.slow
def test_compiled_second_order_forward_mode_and_per_genome_gradients_match_eager():
    """Under `torch.compile`, a custom `autograd.Function` differentiated twice came out wrong
    without a word (MAML's step: 10% of the gradient off, with dynamo's `eager` backend too),
    forward mode (`jvp` of `grad`, `hessian`) and `vmap(grad)` raised torch's internal
    errors, and a `jvp` through the C loops' ops was wrong: there the `torch` path runs the
    specification in plain autograd."""
    from torch.func import hessian, jvp

    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    x, y = torch.randn(3, 16), torch.randn(3, 8)

    def agree(f, *args, backend="eager"):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend=backend)(*args)
        for a, b in zip(tree_leaves(compiled), tree_leaves(f(*args)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    def setup(**options):
        plan = gb.plan(model, hidden=4, condition=2, **options)
        gparams = tree_map(
            lambda t: t + 0.05 * torch.randn_like(t), gb.init(plan, requires_grad=False)
        )
        z = torch.randn(2)

        def loss(g, z=z):
            out = functional_call(model, gb.apply(g, plan, condition=z), (x,))
            return (out - y).square().mean()

        return gparams, z, loss

    for options in ({"tile": (8, 8), "activation": "tanh"}, {"tile": "full", "hashed": 7}):
        gparams, z, loss = setup(**options)

        def maml(g, loss=loss):  # one inner step, differentiated through
            return loss(tree_map(lambda a, b: a - 0.1 * b, g, grad(loss)(g)))

        agree(grad(maml), gparams)
        agree(lambda g, loss=loss: jvp(grad(loss), (g,), (g,))[1], gparams)
        agree(hessian(lambda z, loss=loss, g=gparams: loss(g, z)), z)
    stacked = tree_map(lambda t: torch.stack([t, 1.1 * t]), gparams)
    agree(vmap(grad(loss)), stacked, backend="inductor")
    # One forward-mode level alone: the C loops' ops took it, and their jvp came out wrong
    # (90% off) without a word.
    relu = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    plan = gb.plan(relu, tile=(16, 16), hidden=8)
    gparams = gb.init(plan, requires_grad=False)

    def norm(g):
        return functional_call(relu, gb.apply(g, plan), (x,)).square().sum()

    agree(lambda g: jvp(norm, (g,), (g,))[1], gparams)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_vmap_over_genomes_that_train_backpropagates_as_each_genome_does():
    """`torch.compile(vmap(loss))` over genomes whose leaves require grad: the trace reached
    the loops' ops (row g-nets, a hashed table) without the Functions around them, and they
    had no autograd formula ("Trying to backward through gbfunc.relu_rows.default")."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    plan = gb.plan(model, tile=(16, 16), hidden=8, outputs=16, hashed=40)
    trees = [gb.init(plan, seed=s, requires_grad=False) for s in range(2)]
    stacked = tree_map(lambda *xs: torch.stack(xs).requires_grad_(), *trees)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    loss = loss_fn(model, plan)
    losses = torch.compile(vmap(loss, in_dims=(0, None, None)), fullgraph=True)(stacked, x, y)
    losses.sum().backward()
    for k, tree in enumerate(trees):
        one = grad(loss)(tree, x, y)
        for a, b in zip(tree_leaves(stacked["stacks"]), tree_leaves(one["stacks"]), strict=True):
            torch.testing.assert_close(a.grad[k], b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def compiled_step():
    """One whole training step (generate, forward, loss, grad, AdamW), compiled once."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 5))
    plan = gb.plan(model, tile=(8, 8))
    loss = loss_fn(model, plan)

    def step(gparams, state, x, y):
        grads, value = grad_and_value(loss)(gparams, x, y)
        gparams, state = gb.optim.adamw_update(gparams, grads, state, lr=1e-2, weight_decay=0.01)
        return gparams, state, value, grads

    return plan, step, torch.compile(step, fullgraph=True)


@pytest.mark.slow
@pytest.mark.loops_off  # a whole compiled step, as on platforms without the loops
def test_compiled_training_step_has_no_graph_breaks_and_matches_eager(compiled_step):
    plan, step, compiled = compiled_step
    fresh = gb.init(plan, requires_grad=False)
    explanation = torch._dynamo.explain(step)(fresh, gb.optim.adamw_init(fresh), *batch_xy())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager_g, comp_g = fresh, fresh
    eager_s, comp_s = gb.optim.adamw_init(eager_g), gb.optim.adamw_init(comp_g)
    for i in range(3):
        x, y = batch_xy(seed=i)
        eager_g, eager_s, eager_loss, eager_grads = step(eager_g, eager_s, x, y)
        comp_g, comp_s, comp_loss, comp_grads = compiled(comp_g, comp_s, x, y)
        torch.testing.assert_close(comp_loss, eager_loss, rtol=1e-5, atol=1e-6)
        for a, b in zip(tree_leaves(comp_grads), tree_leaves(eager_grads), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # Adam turns rounding noise on near-zero gradients (e.g. the output bias of a tile that
    # spans every class: softmax gradients sum to zero) into steps of up to lr, so after 3
    # steps the parameters agree to 3 * lr rather than to rounding.
    for a, b in zip(tree_leaves(comp_g), tree_leaves(eager_g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2)
    assert eager_loss < step(fresh, gb.optim.adamw_init(fresh), x, y)[2]


def batch_xy(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(32, 12, generator=gen), torch.randint(0, 5, (32,), generator=gen)


@pytest.mark.slow
def test_compiled_grad_of_shared_gnets_matches_eager():
    """Shared g-nets repeat per-g-net rows over tiles, hashed tables gather per position:
    their backward must compile too. Eager first: the hash it caches inside `grad` must be
    usable by the compiled code (made inside the transform, it was the transform's wrapped
    tensors, which the compiled step cannot read)."""
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, tile=(16, 16), share=True, hidden=8, hashed=20)
    gparams = gb.init(plan, requires_grad=False)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    grad_fn = grad(loss_fn(model, plan))
    eager = grad_fn(gparams, x, y)
    compiled = torch.compile(grad_fn, fullgraph=True)(gparams, x, y)
    for a, b in zip(tree_leaves(compiled), tree_leaves(eager), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_compiled_hash_packs_bucket_and_sign_into_one_int32_losslessly():
    """Compiled code copies the hash as `(bucket + 1) * sign` in int32 and unpacks it."""
    from gbfunc._genome import hash_buckets
    from gbfunc._spec import packed_tile_hash, unpacked

    bucket, sign = hash_buckets(1000, 37)
    packed = packed_tile_hash(1000, 37, torch.device("cpu"))
    assert packed.dtype == torch.int32
    bucket_back, sign_back = unpacked(packed, torch.float64)
    assert torch.equal(bucket_back, bucket)
    assert torch.equal(sign_back, sign)


@pytest.mark.slow
def test_compiled_hashed_genome_reads_its_hash_and_sums_back_without_atomic_scatters():
    """Traced as operations, the hash's argsort and integer arithmetic ran in every compiled
    step (40 of the 42 ms of the MLP's hashed genome); it enters the graph as one opaque op.
    The tables' gradient is `gbfunc::hash_table_gradient` (a C loop), also under `grad`
    (pytorch/pytorch#193279 had dynamo swap it for an `aten.scatter_add`): index_select's
    `index_put` had become a scatter of atomic adds (2.4x the plain step against 1.6x for
    that genome, compiled whole)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from gbfunc.cpu import _hash_gradient

    model = nn.Linear(12, 10)
    # tanh: one-layer ReLU g-nets write their hashed tables in C (`gbfunc.cpu._hash_weights`)
    plan = gb.plan(model, tile=(4, 4), hashed=5, activation="tanh")
    gparams = gb.init(plan, requires_grad=False)
    x, y = batch_xy()
    graphs, aten_graphs = [], []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def recording_aten(gm, example_inputs):
        aten_graphs.append(gm)
        return gm.forward

    loss = loss_fn(model, plan)
    compiled = torch.compile(grad(loss), backend=recording, fullgraph=True)(gparams, x, y)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert any("gbfunc.tile_hash" in t for t in targets)
    assert not any("sort" in t for t in targets)
    for a, b in zip(tree_leaves(compiled), tree_leaves(grad(loss)(gparams, x, y)), strict=True):
        torch.testing.assert_close(a, b)

    inductor_like = aot_autograd(fw_compiler=recording_aten, decompositions=select_decomp_table())
    torch.compile(grad(loss), backend=inductor_like, fullgraph=True)(gparams, x, y)
    aten_ops = {str(node.target) for gm in aten_graphs for node in gm.graph.nodes}
    assert "aten.gather.default" in aten_ops
    assert not {"aten.index_put.default", "aten.index_add.default"} & aten_ops
    if _hash_gradient.usable(torch.float32, "cpu"):  # else the loops are off: a scatter-add
        assert "gbfunc.hash_table_gradient.default" in aten_ops
        assert "aten.scatter_add.default" not in aten_ops


@pytest.mark.slow
def test_compiled_graphs_compute_every_generated_parameter_into_a_buffer_of_its_own():
    """Traced, a generated embedding table is a chain of pointwise ops; inlined into the
    lookup, inductor stored the lookup's activation-sized result instead of recomputing it
    (the main job's transformer, compiled step: 2.8 MiB above the plain model's peak, 0.9
    with the tables realised). Every generated parameter passes through inductor's
    `force_stride_order`, gradients unchanged; eager code never does."""
    from torch._dynamo.backends.common import aot_autograd

    from gbfunc._realised import realised

    model = nn.Sequential(nn.Embedding(11, 8), nn.Flatten(), nn.Linear(24, 5))
    # tanh: one-layer ReLU g-nets' weights come out of C loops, buffers already
    plan = gb.plan(model, tile=(4, 4), embeddings=True, hashed=3, activation="tanh")
    gparams = gb.init(plan, requires_grad=False)
    idx, y = torch.randint(0, 11, (6, 3)), torch.randint(0, 5, (6,))
    forward_graphs = []

    def recording(gm, example_inputs):
        forward_graphs.append(gm)
        return gm.forward

    loss = loss_fn(model, plan)
    backend = aot_autograd(fw_compiler=recording)
    compiled = torch.compile(grad(loss), backend=backend, fullgraph=True)(gparams, idx, y)
    targets = [str(node.target) for gm in forward_graphs for node in gm.graph.nodes]
    assert targets.count("prims.inductor_force_stride_order.default") == len(plan.generated)
    for a, b in zip(tree_leaves(compiled), tree_leaves(grad(loss)(gparams, idx, y)), strict=True):
        torch.testing.assert_close(a, b)
    weight = torch.randn(3, 4)
    assert realised(weight) is weight


@pytest.mark.parametrize(
    ("tile", "outputs"), [((4, 4), 1), ((4, 24), 1), ((4, 24), 4), ((4, 8), 8)]
)
def test_exported_generation_holds_only_standard_ops(tile, outputs):
    """`torch.export` traces `gb.apply` as compiling, but an exported graph is for other
    runtimes: inductor's prim that realises generated parameters stays out of it, and so do
    gbfunc's C loops (one output over 24 columns, a few outputs, row g-nets)."""
    model = nn.Sequential(nn.Embedding(11, 8), nn.Flatten(), nn.Linear(24, 5))
    plan = gb.plan(model, tile=tile, outputs=outputs, hidden=8, embeddings=True)

    class Generated(nn.Module):
        def forward(self, idx, gparams):
            return functional_call(model, gb.apply(gparams, plan), (idx,))

    idx, gparams = torch.randint(0, 11, (6, 3)), gb.init(plan, requires_grad=False)
    exported = torch.export.export(Generated(), (idx, gparams))
    targets = [str(node.target) for node in exported.graph.nodes]
    assert targets
    assert not any("prims." in t or "gbfunc" in t for t in targets)
    torch.testing.assert_close(
        exported.module()(idx, gparams), Generated()(idx, gparams), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_functional_adamw_matches_torch_optim_adamw(weight_decay):
    """gb.optim.adamw_update is torch.optim.AdamW on the same tensors, step for step."""
    model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 5))
    model[1].weight.requires_grad_(False)  # a frozen leaf rides along unchanged
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan, dtype=torch.float64, requires_grad=False)  # no rounding to hide in
    reference = {
        "stacks": {
            key: {k: v.clone().requires_grad_() for k, v in leaves.items()}
            for key, leaves in gparams["stacks"].items()
        },
        "free": {k: v.clone().requires_grad_() for k, v in gparams["free"].items()},
        "frozen": {k: v.clone() for k, v in gparams["frozen"].items()},
    }
    opt = torch.optim.AdamW(gb.trainable_leaves(reference), lr=1e-2, weight_decay=weight_decay)
    state = gb.optim.adamw_init(gparams)
    loss = loss_fn(model, plan)
    for i in range(20):
        x, y = batch_xy(seed=i)
        x = x.double()
        grads = torch.func.grad(loss)(gparams, x, y)
        gparams, state = gb.optim.adamw_update(
            gparams, grads, state, lr=1e-2, weight_decay=weight_decay
        )
        opt.zero_grad()
        loss(reference, x, y).backward()
        opt.step()
    for a, b in zip(tree_leaves(gparams), tree_leaves(reference), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)
    assert torch.equal(gparams["frozen"]["1.weight"], model[1].weight.double())
    # Moments exist for trainable leaves only, and are state, not graph inputs.
    assert set(state["m"]) == set(state["v"]) == {"stacks", "free"}
    assert not any(t.requires_grad for t in tree_leaves(state))


def _adamw_start() -> tuple[dict, dict, dict]:
    """A two-layer MLP's gparams (not requiring grad), a gradient of them, AdamW's start."""
    model = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 5))
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan, requires_grad=False)
    grads = torch.func.grad(loss_fn(model, plan))(gparams, *batch_xy())
    return gparams, grads, gb.optim.adamw_init(gparams)


def test_functional_adamw_names_trees_that_do_not_match_the_gparams():
    # Trees of another plan raised pytree's "Node arity mismatch"; a gradient of shape (1, n)
    # was broadcast into the update.
    gparams, grads, state = _adamw_start()
    other = gb.init(gb.plan(nn.Linear(12, 16), tile=(8, 8)), requires_grad=False)
    flat = dict(grads, free=dict(grads["free"], **{"0.bias": grads["free"]["0.bias"][:1]}))
    for args, message in (
        (
            (grads, gb.optim.adamw_init(other)),
            r"state\['m'\] has no leaf at \['stacks'\]\['s1_5x8'\]",
        ),
        ((other, state), r"grads has no leaf at \['stacks'\]\['s1_5x8'\]\['w_in'\]"),
        ((flat, state), r"grads\['free'\]\['0\.bias'\] has shape \(1,\); gparams' has \(16,\)"),
    ):
        with pytest.raises(ValueError, match=rf"^gb\.optim\.adamw_update: {message}"):
            gb.optim.adamw_update(gparams, *args)
    with pytest.raises(TypeError, match=r"state must be adamw_init's dict, got list"):
        gb.optim.adamw_update(gparams, grads, [state])
    with pytest.raises(TypeError, match=r"state must be adamw_init's dict, got a dict without"):
        gb.optim.adamw_update(gparams, grads, {"m": state["m"], "v": state["v"]})  # KeyError
    empty = dict(grads, free=dict(grads["free"], **{"0.bias": None}))  # AttributeError
    with pytest.raises(TypeError, match=r"grads\['free'\]\['0\.bias'\] is NoneType, not a"):
        gb.optim.adamw_update(gparams, empty, state)
    with pytest.raises(TypeError, match=r"^gb\.optim\.adamw_init: gparams must be the dict"):
        gb.optim.adamw_init([1])


def test_functional_adamw_names_a_bad_rate_beta_epsilon_or_decay():
    """torch's AdamW refuses these; a beta of 1 made every leaf NaN without a word."""
    gparams, grads, state = _adamw_start()
    for kwargs, error, message in (
        ({"betas": (1.0, 0.999)}, ValueError, r"betas\[0\] must be in \[0, 1\), got 1\.0"),
        ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\] must be a number >= 0, got -0\.1"),
        ({"betas": 0.9}, TypeError, r"betas must be a pair of numbers, got 0\.9"),
        ({"lr": float("nan")}, ValueError, r"lr must be a finite number >= 0, got nan"),
        ({"lr": -1e-3}, ValueError, r"lr must be a number >= 0, got -0\.001"),
        ({"lr": "0.1"}, TypeError, r"lr must be a number >= 0, got '0\.1'"),
        ({"eps": -1.0}, ValueError, r"eps must be a number >= 0"),
        ({"weight_decay": -1}, ValueError, r"weight_decay must be a number >= 0"),
    ):
        with pytest.raises(error, match=rf"^gb\.optim\.adamw_update: {message}"):
            gb.optim.adamw_update(gparams, grads, state, **kwargs)
    stepped, _ = gb.optim.adamw_update(gparams, grads, state, lr=torch.tensor(1e-3))
    assert not any(t.isnan().any() for t in tree_leaves(stepped))  # a tensor rate is a rate


def test_functional_adamw_keeps_a_0_dim_leafs_dtype():
    """A 0-dim leaf (a learnable scale, free) took the float64 of the 0-dim bias corrections,
    and the next gb.apply refused the mixed dtypes."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    model = Scaled()
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan, requires_grad=False)
    x = torch.randn(3, 8)

    def loss(gparams):
        return functional_call(model, gb.apply(gparams, plan), (x,)).square().mean()

    state = gb.optim.adamw_init(gparams)
    for _ in range(2):
        gparams, state = gb.optim.adamw_update(gparams, torch.func.grad(loss)(gparams), state)
    assert gparams["free"]["scale"].dtype == torch.float32
    assert gparams["free"]["scale"].item() != 1.0  # it trained
    assert loss(gparams).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_functional_adamw_keeps_16_bit_leaves_finite(dtype):
    """In float16 a gradient below 2.4e-4 squared to 0, and eps to 0: the step divided by
    zero (inf after one step). The moments are float32; the leaves keep their dtype."""
    model = nn.Linear(32, 16)
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan, requires_grad=False, dtype=dtype)
    grads = torch.utils._pytree.tree_map(lambda t: torch.full_like(t, 1e-5), gparams)
    state = gb.optim.adamw_init(gparams)
    new, state = gb.optim.adamw_update(gparams, grads, state)
    leaves = torch.utils._pytree.tree_leaves(new["stacks"])
    assert all(t.dtype == dtype and torch.isfinite(t).all() for t in leaves)
    assert all(t.dtype == torch.float32 for t in torch.utils._pytree.tree_leaves(state["m"]))
    leaf = new["stacks"][plan.stacks[0].key]["w_in"]
    before = gparams["stacks"][plan.stacks[0].key]["w_in"]
    moved = (before.float() - leaf.float()).abs().max().item()  # Adam's first step: about lr
    assert 5e-4 < moved < 2e-3


def test_functional_adamw_defaults_are_lr_1e_3_without_weight_decay():
    """The defaults are documented values (torch's AdamW decays by 1e-2; this one does not)."""
    gparams, grads, state = _adamw_start()
    default, _ = gb.optim.adamw_update(gparams, grads, state)
    explicit, _ = gb.optim.adamw_update(gparams, grads, state, lr=1e-3, weight_decay=0.0)
    for a, b in zip(tree_leaves(default), tree_leaves(explicit), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_eager_apply_through_the_plans_graph_matches_plain_eager_and_compiles_once():
    """`gb.apply(compile=True)`: same weights and gradients from one graph per plan, compiled
    on the first call and not again; under `torch.func.grad` the same gradients (the graph is
    not used there); a double backward and batched gradients, which the graph's compiled
    backward cannot take (they raised torch's errors), made op by op: the same as without
    the graph."""
    from torch._dynamo.utils import counters

    model = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 7))  # ragged tiles
    plan = gb.plan(model, tile=(16, 16), hidden=8, activation="gelu", hashed=7)
    assert gb.explain(gb.init(plan), plan, compile=True).route.plan == "graph"
    x = torch.randn(5, 48)

    def loss(gparams, compile):
        out = functional_call(model, gb.apply(gparams, plan, compile=compile), (x,))
        return out.square().mean()

    def grads(compile):
        gparams = gb.init(plan, seed=3)
        loss(gparams, compile).backward()
        return [leaf.grad for leaf in gb.trainable_leaves(gparams)]

    expected = grads(False)
    before = counters["stats"]["unique_graphs"]
    for leaf, ref in zip(grads(True), expected, strict=True):
        torch.testing.assert_close(leaf, ref, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1
    grads(True)  # the same plan again: nothing new compiled
    assert counters["stats"]["unique_graphs"] - before == 1
    gparams = gb.init(plan, seed=3)
    functional = grad(loss)(gparams, True)
    torch.testing.assert_close(functional, grad(loss)(gparams, False))
    leaves = gb.trainable_leaves(gparams)

    def penalty_grads(compile: bool) -> tuple[torch.Tensor, ...]:  # a gradient penalty's
        first = torch.autograd.grad(loss(gparams, compile), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    for leaf, ref in zip(penalty_grads(True), penalty_grads(False), strict=True):
        torch.testing.assert_close(leaf, ref, rtol=1e-4, atol=1e-7)

    def batched(compile: bool) -> tuple[torch.Tensor, ...]:  # rows of a Jacobian
        weight = gb.apply(gparams, plan, compile=compile)["0.weight"]
        rows = torch.eye(weight.numel())[:3].reshape(3, *weight.shape)
        return torch.autograd.grad(weight, leaves, rows, is_grads_batched=True, allow_unused=True)

    for leaf, ref, tensor in zip(batched(True), batched(False), leaves, strict=True):
        zeros = torch.zeros(3, *tensor.shape)  # a leaf the weight does not read: no gradient
        torch.testing.assert_close(
            zeros if leaf is None else leaf, zeros if ref is None else ref, rtol=1e-4, atol=1e-7
        )
    once = torch.autograd.grad(loss(gparams, True), leaves)
    retained = loss(gparams, True)  # a retained graph, backward twice (donated buffers raised)
    retained.backward(retain_graph=True)
    retained.backward()
    for leaf, ref in zip(leaves, once, strict=True):
        torch.testing.assert_close(leaf.grad, 2 * ref, rtol=1e-4, atol=1e-7)
    assert counters["stats"]["unique_graphs"] - before == 1  # still the one graph
    # A frozen stack (its weight made without gradient) in a double backward: this raised
    # "element 0 of tensors does not require grad" before 2026-12-02's hooks.
    frozen, *_ = gparams["stacks"].values()
    for tensor in frozen.values():
        tensor.requires_grad_(False)
    leaves = [leaf for leaf in leaves if leaf.requires_grad]
    for leaf, ref in zip(penalty_grads(True), penalty_grads(False), strict=True):
        torch.testing.assert_close(leaf, ref, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_the_plans_graph_keeps_its_stacks_order_where_the_models_differs():
    """Two stacks whose weights interleave in the model (0 and 2 in one, 1 in the other):
    the compiled graph returns them stack by stack. Read in the model's order, its outputs
    did not line up with its backward node's, and every call ran op by op after the
    compiled forward, without a word (2026-12-02, found in review)."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    wide = {"1.weight": {"hidden": 16}}
    plan = gb.plan(model, tile=(16, 16), hidden=8, activation="gelu", overrides=wide)
    assert len(plan.stacks) == 2
    gparams = gb.init(plan, seed=1)
    weights = gb.apply(gparams, plan, compile=True)
    assert {type(weights[f"{i}.weight"].grad_fn).__name__ for i in range(3)} == {
        "CompiledFunctionBackward"
    }
    leaves, x = gb.trainable_leaves(gparams), torch.randn(4, 32)

    def penalty_grads(compile: bool) -> tuple[torch.Tensor, ...]:
        out = functional_call(model, gb.apply(gparams, plan, compile=compile), (x,))
        first = torch.autograd.grad(out.square().mean(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    for leaf, ref in zip(penalty_grads(True), penalty_grads(False), strict=True):
        torch.testing.assert_close(leaf, ref, rtol=1e-4, atol=1e-7)


def test_a_compiled_backward_that_donates_its_buffers_is_refused_not_raised():
    """A compiled backward whose first run freed its graph reuses the saved tensors' memory
    and raises on any backward that keeps the graph; the graph path's first retained
    backward reports that (and then runs op by op) instead of failing `gb.apply`."""
    from gbfunc.generate.graph import _compile_backward_keeping_graphs

    a = torch.randn(8, 8, requires_grad=True)
    compiled = torch.compile(lambda a: torch.tanh(a @ a.T) @ a, fullgraph=True)
    compiled(a).sum().backward()  # the first backward frees the graph: buffers donated
    refused = _compile_backward_keeping_graphs([compiled(a)], [a])
    assert "donated buffers" in (refused or "")
    # Another graph (the same one would be loaded from AOTAutograd's cache, donating).
    fresh = torch.compile(lambda a: torch.sin(a @ a.T) @ a, fullgraph=True)
    out = fresh(a)
    assert _compile_backward_keeping_graphs([out], [a]) is None  # compiled keeping them
    out.sum().backward(retain_graph=True)
    out.sum().backward()  # a retained graph's second backward


def runs_as_graph(plan: gb.Plan, compile: bool | None) -> bool:
    """Whether eager `gb.apply(compile=compile)` would compile `plan` as one graph, the CPU
    loops aside (they run in the graph, or on their own where they take every stack)."""
    from gbfunc.cpu import _mode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_mode, "_forced", "off")
        return gb.explain(gb.init(plan), plan, compile=compile).route.plan == "graph"


def test_plans_run_as_one_graph_where_it_pays_and_holds_no_large_transient(monkeypatch):
    from gbfunc.generate import compiled_mlp
    from gbfunc.generate._policy import AUTO_GRAPH_WEIGHTS
    from gbfunc.generate.graph import fits_graph

    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(784, 512), nn.Linear(512, 512))  # 663,552 weights
        small = nn.Linear(64, 64)
    rows = gb.plan(big, tile=(128, 128), hidden=8, outputs=128)
    assert sum(p.numel for p in rows.generated) >= AUTO_GRAPH_WEIGHTS
    assert runs_as_graph(rows, None)
    assert runs_as_graph(rows, True)
    with torch.no_grad():  # evaluation: compiled only when asked
        assert not runs_as_graph(rows, None)
        assert runs_as_graph(rows, True)
    assert not runs_as_graph(rows, False)
    tiny = gb.plan(small, tile=(16, 16))
    assert not runs_as_graph(tiny, None)
    assert runs_as_graph(tiny, True)
    # From exactly the threshold on: 512 x 512 = 2**18 weights; one row fewer is below it.
    with torch.device("meta"):
        edge, under = nn.Linear(512, 512, bias=False), nn.Linear(512, 511, bias=False)
    assert runs_as_graph(gb.plan(edge, tile=(128, 128)), None)
    assert not runs_as_graph(gb.plan(under, tile=(128, 128), hidden=3), None)
    # A stack whose hidden activations feed a matmul (several outputs) and exceed one compiled
    # chunk runs in chunks instead, even when asked to compile; one output fuses: any size.
    (wide,) = gb.plan(small, tile=(16, 16), hidden=8, outputs=4).stacks
    (fused,) = gb.plan(small, tile=(16, 16), hidden=8).stacks
    transient = 16 * 16 * 16 // 4 * 8  # tiles x rows x evaluation columns x hidden
    monkeypatch.setattr(compiled_mlp, "COMPILED_CHUNK_ELEMENTS", transient)
    assert fits_graph(wide)
    assert fits_graph(fused)
    monkeypatch.setattr(compiled_mlp, "COMPILED_CHUNK_ELEMENTS", transient - 1)
    assert not fits_graph(wide)
    assert fits_graph(fused)
    assert not runs_as_graph(gb.plan(small, tile=(16, 16), hidden=8, outputs=4), True)
    deep = gb.plan(small, tile=(16, 16), hidden=8, depth=2)
    monkeypatch.setattr(compiled_mlp, "COMPILED_CHUNK_ELEMENTS", 16 * 16 * 16 * 8 - 1)
    assert not runs_as_graph(deep, True)


def test_eager_graph_checks_only_its_tensors_and_torchs_global_state(monkeypatch):
    """Dynamo checks a compiled function's guards on every call. gb.apply's graph had 436 on
    the MLP with row g-nets, most on the plan's layout, which its cache key fixes (0.2 ms a
    step); only those on the g-nets' tensors and on global state (grad mode...) are kept."""
    from gbfunc.generate import _compiled, graph as _graph
    from gbfunc.generate._compiled import CompiledCache

    kept, dropped = [], []

    def recording(entries):
        flags = filter_guards(entries)
        for entry, keep in zip(entries, flags, strict=True):
            (kept if keep else dropped).append(entry)
        return flags

    filter_guards = _compiled._tensor_and_global_state_guards
    monkeypatch.setattr(_compiled, "_tensor_and_global_state_guards", recording)
    monkeypatch.setattr(_graph, "_GRAPHS", CompiledCache("gb.apply's graph"))
    model = nn.Sequential(nn.Linear(24, 20), nn.ReLU(), nn.Linear(20, 6))
    # tanh: eagerly, one-layer ReLU g-nets run C loops, not a graph
    plan = gb.plan(model, tile=(8, 8), hidden=4, activation="tanh")
    gparams = gb.init(plan, seed=2)
    expected = gb.apply(gparams, plan, compile=False)
    first = gb.apply(gparams, plan, compile=True)
    tensors = {e.name for e in kept if e.guard_type == "TENSOR_MATCH"}
    leaves = gparams["stacks"].items()
    assert tensors == {f"stacks[{s!r}][{k!r}]" for s, stack in leaves for k in stack}
    assert {"GRAD_MODE", "GLOBAL_STATE", "DEFAULT_DEVICE"} <= {e.guard_type for e in kept}
    assert all(not e.name or e.guard_type in _compiled._TENSOR_GUARDS for e in kept)
    # the plan, whose layout the graph holds
    assert any(e.name.startswith("plan.") for e in dropped), [e.name for e in dropped][:20]
    # What is still checked still works: under no_grad the graph is traced again, without
    # autograd, and the first graph serves the next call with gradients.
    with torch.no_grad():
        evaluated = gb.apply(gparams, plan, compile=True)
    again = gb.apply(gparams, plan, compile=True)
    for name, value in expected.items():
        for params in (first, evaluated, again):
            torch.testing.assert_close(params[name], value)
    for name in (p.name for p in plan.generated):
        assert first[name].requires_grad
        assert again[name].requires_grad
        assert not evaluated[name].requires_grad


def test_a_compiled_caller_has_no_guard_per_tile():
    """A user's compiled function that applies a plan is guarded on the plan's attributes it
    reads. `Stack.num_tiles` summed `tiles_per_gnet` there, one guard per g-net: 2,513 on a
    width-1024 transformer, 0.23 ms a step. It is counted once when the stack is made."""
    model = nn.Linear(64, 48)
    plan = gb.plan(model, tile=(8, 8), hidden=4)  # 48 tiles, one g-net each
    (stack,) = plan.stacks
    assert stack.num_tiles == len(stack.tiles_per_gnet) == 48
    names = []

    def recording(entries):
        names.extend(e.name for e in entries)
        return [True] * len(entries)

    gparams = gb.init(plan, seed=0)
    compiled = torch.compile(
        lambda g: gb.apply(g, plan)["weight"].sum(),
        fullgraph=True,
        options={"guard_filter_fn": recording},
    )
    expected = gb.apply(gparams, plan, compile=False)["weight"].sum()
    torch.testing.assert_close(compiled(gparams), expected)
    assert any(name.endswith(".stacks[0]") for name in names)  # the plan's reads are guarded
    assert not [name for name in names if "tiles_per_gnet[" in name]


def test_what_the_plan_fixes_is_computed_once_not_traced(monkeypatch):
    """Where a stack's tiles land for the CPU loops (`cpu.placement`, a loop over every tile)
    is computed in Python when `torch.compile` traces `gb.apply`, once per plan and stack,
    not traced: traced, it took a third of a two-layer GPT-2 step's compile (2,796 tiles;
    `benchmarks/results/compile_time.md`), and its side effects would be replayed on every
    call. Nor does `gb.apply` build a selection's per-tile layout (`Selection`), traced or
    not: it lays out whole blocks."""
    import gbfunc._select as select
    from gbfunc.cpu import unavailable_reason
    from gbfunc.generate import cpu_loops

    placed, selections = [], []
    placement = cpu_loops.placement

    def counted(stack, params):
        placed.append(stack.key)
        return placement(stack, params)

    monkeypatch.setattr(cpu_loops, "placement", counted)
    monkeypatch.setattr(select.Selection, "__init__", lambda *args: selections.append(args))
    model = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
    plan = gb.plan(model, tile=(4, 4), hidden=4)
    gparams = gb.init(plan, seed=0)
    compiled = torch.compile(lambda g: gb.apply(g, plan)["0.weight"].sum(), fullgraph=True)
    expected = gb.apply(gparams, plan, compile=False)["0.weight"].sum()
    assert placed == []  # eager and small: no loops, so no placement
    for _ in range(3):
        torch.testing.assert_close(compiled(gparams), expected)
    # once per stack, in the one trace, where the loops generate them (none where they are off)
    loops = unavailable_reason() is None
    assert placed == ([s.key for s in plan.stacks] if loops else [])
    assert selections == []


def test_eager_compiles_fuse_multiply_adds_without_touching_inductors_settings(monkeypatch):
    from torch._inductor import config as inductor_config

    from gbfunc.generate._compiled import CompiledCache

    seen = []

    def recording(fn, **kwargs):
        seen.append(kwargs["options"])
        return fn

    monkeypatch.setattr(torch, "compile", recording)
    before = inductor_config.get_config_copy()
    x = torch.randn(3)
    result = CompiledCache("a test").call("key", lambda t: t.sin(), x)
    torch.testing.assert_close(result, x.sin())
    (options,) = seen
    assert options["cpp.enable_floating_point_contract_flag"] == "fast"
    assert callable(options["guard_filter_fn"])
    assert inductor_config.get_config_copy() == before


@pytest.mark.parametrize(
    "error",
    [
        torch._dynamo.exc.BackendCompilerFailed(print, RuntimeError("no gcc"), None),
        # fullgraph=True raises past dynamo's recompile limit, where others fall back to eager
        torch._dynamo.exc.FailOnRecompileLimitHit("no gcc: recompile_limit reached"),
    ],
    ids=["compile failed", "recompile limit"],
)
def test_a_plan_that_fails_to_compile_warns_once_and_runs_op_by_op(monkeypatch, error):
    from gbfunc.generate import _compiled as _compiled_module, graph as _graph
    from gbfunc.generate._compiled import CompiledCache

    calls = []

    def failing(*args):
        calls.append(1)
        raise error

    monkeypatch.setattr(torch, "compile", lambda fn, **options: failing)
    # Tried even where dynamo is switched off (under mutmut): torch.compile is the fake above.
    monkeypatch.setattr(_compiled_module, "dynamo_disabled", lambda: False)
    monkeypatch.setattr(_graph, "_GRAPHS", CompiledCache("gb.apply's graph"))
    model = nn.Linear(24, 20)
    # tanh: eagerly, one-layer ReLU g-nets run C loops, not a graph
    plan = gb.plan(model, tile=(8, 8), hidden=4, activation="tanh")
    gparams = gb.init(plan, seed=1)
    expected = gb.apply(gparams, plan, compile=False)
    with pytest.warns(RuntimeWarning) as warned:
        first = gb.apply(gparams, plan, compile=True)
    # The graph, tried once; its stacks then run op by op (the dispatcher's `torch`).
    messages = [str(w.message) for w in warned]
    assert len(messages) == len(calls) == 1
    assert re.search(r"(?s)compiling gb\.apply's graph failed.*no gcc", messages[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = gb.apply(gparams, plan, compile=True)  # no second try, no second warning
    assert len(calls) == 1
    for params in (first, second):
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value)


def test_the_graph_is_compiled_per_grad_mode_and_leaf_dtypes_and_flags(monkeypatch):
    """Dynamo recompiles one code object for a new grad mode, dtype or `requires_grad`, and
    with fullgraph=True raised past its limit of 8 (a freezing schedule, with evaluation
    between, reached it). Each of them is now part of the key, so each compiles its own copy."""
    from gbfunc.generate import graph as _graph
    from gbfunc.generate._compiled import CompiledCache

    keys = []
    cache = CompiledCache("gb.apply's graph")
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # op by op, counted
    monkeypatch.setattr(_graph, "_GRAPHS", cache)
    monkeypatch.setattr(cache, "_compiled", _Recording(keys))
    model = nn.Linear(24, 20)
    plan = gb.plan(model, tile=(8, 8), hidden=4, activation="tanh")
    gparams = gb.init(plan, seed=1)
    gb.apply(gparams, plan, compile=True)
    gb.apply(gparams, plan, compile=True)  # the same key
    with torch.no_grad():
        gb.apply(gparams, plan, compile=True)
    (leaves,) = gparams["stacks"].values()
    leaves["w_in"].requires_grad_(False)
    gb.apply(gparams, plan, compile=True)
    assert len(keys) == len(set(keys)) == 3


class _Recording(dict):
    """A dict that records each key set in it."""

    def __init__(self, keys: list) -> None:
        super().__init__()
        self.keys_set = keys

    def __setitem__(self, key, value) -> None:
        self.keys_set.append(key)
        super().__setitem__(key, value)


def test_eager_apply_runs_op_by_op_while_dynamo_is_switched_off(monkeypatch):
    """`torch._dynamo.config.disable` (a debugging setting) made gb.apply's compiled graph
    raise "found no compiled frames"; it now runs op by op, with no warning."""
    from gbfunc.generate import compiled_mlp, graph as _graph
    from gbfunc.generate._compiled import CompiledCache

    monkeypatch.setattr(_graph, "_GRAPHS", CompiledCache("gb.apply's graph"))
    monkeypatch.setattr(compiled_mlp, "_BODIES", CompiledCache("the tile MLP"))
    model = nn.Linear(24, 20)
    plan = gb.plan(model, tile=(8, 8), hidden=4)
    gparams = gb.init(plan, seed=1)
    expected = gb.apply(gparams, plan, compile=False)
    with torch._dynamo.config.patch(disable=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        params = gb.apply(gparams, plan, compile=True)
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value)


@pytest.mark.slow
def test_compiled_bodies_of_a_multi_output_stack_run_in_balanced_chunks(monkeypatch):
    """With several outputs the hidden activations are matmul operands that inductor
    materialises, so compiled bodies run on chunks of tiles (bounding the step's peak memory);
    the chunks are balanced, so one chunk size compiles once for the forward and the backward."""
    from torch._dynamo.utils import counters

    from gbfunc.generate import compiled_mlp

    model = nn.Linear(48, 32, bias=False)  # (16, 16) tiles: 2 x 3 = 6 tiles
    plan = gb.plan(model, tile=(16, 16), hidden=8, outputs=4)
    (stack,) = plan.stacks
    per_tile = 16 * (16 // 4) * 8  # tile rows x evaluations per row x hidden units
    # Four tiles per chunk: 4 + 2 unbalanced (two sizes), 3 + 3 balanced (one).
    monkeypatch.setattr(compiled_mlp, "COMPILED_CHUNK_ELEMENTS", 4 * per_tile)
    chunk_tiles = []
    compiled = compiled_mlp._compiled

    def spy(body, first, *rest):
        chunk_tiles.append(first.shape[0])
        return compiled(body, first, *rest)

    monkeypatch.setattr(compiled_mlp, "_compiled", spy)
    x = torch.randn(5, 48)

    def grads(compile):
        gparams = gb.init(plan, seed=4)
        out = functional_call(model, gb.apply(gparams, plan, compile=compile), (x,))
        out.square().mean().backward()
        return [leaf.grad for leaf in gb.trainable_leaves(gparams)]

    expected = grads(False)
    before = counters["stats"]["unique_graphs"]
    for leaf, ref in zip(grads(True), expected, strict=True):
        torch.testing.assert_close(leaf, ref, rtol=1e-4, atol=1e-6)
    assert stack.num_tiles == 6
    assert chunk_tiles == [3, 3, 3, 3]  # forward, then backward, in two chunks each
    assert counters["stats"]["unique_graphs"] - before == 2


def test_apply_compiles_only_stacks_large_enough_to_pay_by_default():
    from gbfunc.generate._policy import AUTO_COMPILE_ELEMENTS, compiles_eagerly

    with torch.device("meta"):
        big, small = nn.Linear(2048, 2048), nn.Linear(64, 64)
    (large,) = gb.plan(big, tile=(128, 128)).stacks  # 256 tiles x 128 x 128 x 32 hidden
    (tiny,) = gb.plan(small, tile=(16, 16)).stacks
    assert large.num_tiles * 128 * 128 * 32 >= AUTO_COMPILE_ELEMENTS
    assert compiles_eagerly(large, None)
    assert not compiles_eagerly(tiny, None)
    assert not compiles_eagerly(large, False)
    assert compiles_eagerly(tiny, True)
    # The measure is the transient (tiles, tile rows, evaluation columns, hidden), from exactly
    # the threshold on: one (128, 256) tile at 32 hidden units is 2**20; (64, 256) half.
    with torch.device("meta"):
        (edge,) = gb.plan(nn.Linear(256, 128), tile=(128, 256)).stacks
        (half,) = gb.plan(nn.Linear(256, 64), tile=(64, 256)).stacks
    assert edge.num_tiles * edge.tile[0] * edge.columns * 32 == AUTO_COMPILE_ELEMENTS
    assert compiles_eagerly(edge, None)
    assert not compiles_eagerly(half, None)
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    with pytest.raises(TypeError, match=r"gb\.apply: compile must be True, False or None"):
        gb.apply(gb.init(plan), plan, compile=1)


def test_vmap_with_some_leaves_shared_equals_the_loop():
    """Genomes that differ only in their output layers: the rest enters vmap unbatched."""
    model = tiny_model(False)
    plan = gb.plan(model, **GENOMES["default"])
    trees, stacked = stack_genomes(plan, range(3))
    shared = {
        key: {
            name: t if name in ("w_out", "b_out") else trees[0]["stacks"][key][name]
            for name, t in leaves.items()
        }
        for key, leaves in stacked["stacks"].items()
    }
    dims = {
        key: {name: 0 if name in ("w_out", "b_out") else None for name in leaves}
        for key, leaves in shared.items()
    }
    gparams = {"stacks": shared, "free": trees[0]["free"], "frozen": trees[0]["frozen"]}
    in_dims = ({"stacks": dims, "free": None, "frozen": None}, None)
    out = vmap(gb.apply, in_dims=in_dims)(gparams, plan)
    for k in range(3):
        one = {
            "stacks": {
                key: {name: t[k] if dims[key][name] == 0 else t for name, t in leaves.items()}
                for key, leaves in shared.items()
            },
            "free": trees[0]["free"],
            "frozen": trees[0]["frozen"],
        }
        for name, value in gb.apply(one, plan).items():
            torch.testing.assert_close(out[name][k], value, rtol=1e-6, atol=1e-7, msg=name)
