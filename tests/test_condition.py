"""Conditional genomes: one genome, a weight set per condition or per learned task.

`gb.plan(..., condition=w, tasks=n)`; `gb.apply(gparams, plan, condition=z)` or `task=i`.
Every path is compared with `tests/naive.py`, which adds `z @ w_cond` to each g-net's first
layer from the definition, one tile at a time.
"""

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings, strategies as st
from naive import naive_apply
from torch import nn
from torch.func import functional_call, grad, vmap

import gbfunc as gb
from gbfunc._serial import plan_from_json, plan_to_json
from gbfunc.cpu import _build

needs_loops = pytest.mark.skipif(
    _build.flavour() is None or _build.compiler() is None,
    reason="the loops are not built on this machine (mode, platform or compiler)",
)


def mlp(inputs: int = 12, hidden: int = 10, outputs: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


def conditioned(plan: gb.Plan, seed: int = 0) -> dict:
    """`gb.init(plan)` with `w_cond` drawn (it starts at zero, where conditions do not matter)."""
    gparams = gb.init(plan, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for leaves in gparams["stacks"].values():
            if "w_cond" in leaves:
                leaves["w_cond"].copy_(torch.randn(leaves["w_cond"].shape, generator=gen))
    return gparams


def close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name].to(got[name].dtype), atol=1e-5, rtol=1e-4)


@st.composite
def conditioned_plans(draw) -> tuple[gb.Plan, torch.Tensor]:
    inputs, hidden = draw(st.integers(3, 13)), draw(st.integers(2, 11))
    genome = {
        "tile": draw(st.sampled_from([(2, 3), (4, 4), (3, 5), "full"])),
        "hidden": draw(st.sampled_from([2, 5])),
        "depth": draw(st.integers(1, 2)),
        "activation": draw(st.sampled_from(["relu", "tanh", "gelu"])),
        "share": draw(st.booleans()),
        "hashed": draw(st.sampled_from([0, 3])),
        "biases": draw(st.booleans()),
    }
    width = draw(st.integers(1, 4))
    plan = gb.plan(mlp(inputs, hidden), condition=width, **genome)
    z = torch.randn(width, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return plan, z


@settings(max_examples=25, deadline=None)
@given(conditioned_plans())
def test_apply_with_a_condition_equals_the_per_tile_reference(case):
    plan, z = case
    gparams = conditioned(plan)
    close(gb.apply(gparams, plan, condition=z), naive_apply(gparams, plan, z))


def test_conditions_start_neutral_and_the_other_leaves_start_as_without_one():
    plain = gb.plan(mlp(), tile=(4, 4), hidden=5)
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    gparams, reference = gb.init(plan, seed=3), gb.init(plain, seed=3)
    for key, leaves in gparams["stacks"].items():
        assert torch.equal(leaves["w_cond"], torch.zeros(leaves["w_in"].shape[0], 3, 5))
        assert leaves.keys() - reference["stacks"][key].keys() == {"w_cond"}
        for name, value in reference["stacks"][key].items():
            assert torch.equal(value, leaves[name]), name
    assert gparams["tasks"].shape == (4, 3)
    assert gparams["tasks"].requires_grad
    weights = [gb.apply(gparams, plan, task=i)["0.weight"] for i in range(4)]
    assert all(torch.equal(w, weights[0]) for w in weights)
    assert torch.equal(weights[0], gb.apply(reference, plain)["0.weight"])
    meta = gb.init(plan, device="meta")
    assert meta["tasks"].is_meta
    assert meta["tasks"].shape == (4, 3)


def test_an_override_leaves_a_layer_unconditioned():
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=2, overrides={"2.*": {"condition": 0}})
    gparams = conditioned(plan)
    first, last = (plan.stacks[plan.params[i].stack_index] for i in (0, 2))
    assert first.genome.condition == 2
    assert last.genome.condition == 0
    a = gb.apply(gparams, plan, condition=torch.tensor([1.0, 0.0]))
    b = gb.apply(gparams, plan, condition=torch.tensor([0.0, 1.0]))
    assert not torch.equal(a["0.weight"], b["0.weight"])
    assert torch.equal(a["2.weight"], b["2.weight"])


@needs_loops
@pytest.mark.parametrize(
    ("options", "path"),
    [
        ({"tile": (16, 16), "hidden": 8, "outputs": 16}, ("stacks", "cpu-loops")),
        ({"tile": (16, 16), "hidden": 8, "depth": 2}, ("graph", "graph")),
    ],
    ids=["cpu-loops", "graph"],
)
def test_each_compiled_path_takes_the_condition_forward_and_backward(options, path):
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, condition=3, tasks=2, **options)
    gparams = conditioned(plan)
    route = gb.explain(gparams, plan, compile=True).route
    assert (route.plan, route.stacks[0]) == path
    x = torch.randn(5, 40)

    def loss(gparams, compile):
        params = gb.apply(gparams, plan, task=1, compile=compile)
        return functional_call(model, params, (x,)).square().mean()

    compiled = loss(gparams, True)
    compiled.backward()
    with torch.no_grad():  # numpy's integers: dynamo took one for a tensor on the graph path
        numpy_task = gb.apply(gparams, plan, task=np.int64(1), compile=True)
        close(numpy_task, gb.apply(gparams, plan, task=1, compile=True))
    got = {"tasks": gparams["tasks"].grad.clone()}
    got.update({k: v["w_cond"].grad.clone() for k, v in gparams["stacks"].items()})
    for leaf in gb.trainable_leaves(gparams):
        leaf.grad = None
    eager = loss(gparams, False)
    eager.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["tasks"], gparams["tasks"].grad, rtol=1e-4, atol=1e-6)
    for key, leaves in gparams["stacks"].items():
        torch.testing.assert_close(got[key], leaves["w_cond"].grad, rtol=1e-4, atol=1e-6)


def test_gradients_of_the_condition_and_w_cond_equal_the_reference():
    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=3, share=True, hashed=4)
    gparams = conditioned(plan)
    x, z = torch.randn(6, 12), torch.randn(3)

    def loss(apply, gparams, z):
        return functional_call(model, apply(gparams, z), (x,)).square().mean()

    def fast(g, z):
        return gb.apply(g, plan, condition=z)

    def slow(g, z):
        return naive_apply(g, plan, z)

    got = grad(loss, argnums=(1, 2))(fast, gparams, z)
    want = grad(loss, argnums=(1, 2))(slow, gparams, z)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-4, atol=1e-6)
    for key in gparams["stacks"]:
        torch.testing.assert_close(
            got[0]["stacks"][key]["w_cond"], want[0]["stacks"][key]["w_cond"], rtol=1e-4, atol=1e-6
        )


def test_vmap_over_conditions_and_tasks_gives_one_weight_set_each():
    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=3, tasks=4)
    gparams = conditioned(plan)
    zs = torch.randn(5, 3)
    batched = vmap(lambda z: gb.apply(gparams, plan, condition=z))(zs)
    for i, z in enumerate(zs):
        close({k: v[i] for k, v in batched.items()}, gb.apply(gparams, plan, condition=z))
    per_task = vmap(lambda t: gb.apply(gparams, plan, task=t))(torch.arange(4))
    for i in range(4):
        close({k: v[i] for k, v in per_task.items()}, gb.apply(gparams, plan, task=i))
    # per-sample weights: each input through the weights of its own condition
    x = torch.randn(5, 12)

    def one(z, xi):
        return functional_call(model, gb.apply(gparams, plan, condition=z), (xi[None],))[0]

    out = vmap(one)(zs, x)
    for i in range(5):
        torch.testing.assert_close(out[i], one(zs[i], x[i]))


def test_a_compiled_step_with_a_condition_is_one_graph_and_equals_eager():
    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=2, tasks=3)
    gparams = conditioned(plan)
    x = torch.randn(4, 12)

    def loss(gparams, task):
        return functional_call(model, gb.apply(gparams, plan, task=task), (x,)).square().mean()

    step = torch.compile(grad(loss), fullgraph=True)
    task = torch.tensor(2)
    got, want = step(gparams, task), grad(loss)(gparams, task)
    torch.testing.assert_close(got["tasks"], want["tasks"], rtol=1e-4, atol=1e-6)
    assert bool(want["tasks"][2].abs().sum() > 0)
    assert bool((want["tasks"][:2] == 0).all())


def test_a_compiled_bottleneck_takes_every_task_without_recompiling():
    # An int `b.task` read by `forward` made dynamo recompile per task, eager after 8.
    net = gb.Bottleneck(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=10)
    net.load_gparams(conditioned(net.plan))
    x = torch.randn(2, 12)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(net, backend=counting, fullgraph=True)
    for task in range(10):
        net.task = task
        torch.testing.assert_close(compiled(x), net(x))
        assert net.task == task
    assert len(graphs) == 1
    net.task = None
    unset = r"^gb\.Bottleneck: its g-nets read a condition of width 3: set b\.task \(0\.\.9\) or "
    with pytest.raises(ValueError, match=unset + r"b\.condition \(a tensor of shape \(3,\)\)"):
        net(x)
    with pytest.raises(ValueError, match=unset):
        net.export()
    with pytest.raises(ValueError, match=unset):
        net.calibrate(x)
    net.task, net.condition = 1, torch.ones(3)
    with pytest.raises(ValueError, match=r"^gb\.Bottleneck: both b\.task and b\.condition"):
        net(x)
    net.task = None
    for bad, message in ((torch.ones(4), r"shape \(4,\)"), ("x", "got str")):
        net.condition = bad  # named as the module's (they were gb.apply's)
        with pytest.raises(
            (ValueError, TypeError), match=rf"^gb\.Bottleneck: condition .*{message}"
        ):
            net(x)
    net.condition = None
    net.task = torch.tensor(3)  # a 0-d integer tensor, as gb.apply and gb.continual take
    assert net.task == 3
    assert type(net.task) is int
    net.task = None
    for bad, error in ((10, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match=r"^gb\.Bottleneck: task must be an int in 0\.\.9"):
            net.task = bad
    plain = gb.Bottleneck(mlp(), tile=(4, 4), hidden=5, condition=3)
    with pytest.raises(ValueError, match=r"^gb\.Bottleneck\.task: this module has no task"):
        plain.task = 0
    net.task = 3
    net.to("meta")  # the task's tensor moves with the module, as a buffer would
    assert net._task_index.device.type == net.tasks.device.type == "meta"


def test_checkpoints_module_export_report_and_optimizer_keep_the_task_embeddings(tmp_path):
    model = mlp()
    net = gb.Bottleneck(model, tile=(4, 4), hidden=5, condition=3, tasks=4)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("w_cond"):
                p.normal_()
    x = torch.randn(2, 12)
    with pytest.raises(ValueError, match=r"condition of width 3: set b\.task \(0\.\.3\) or b"):
        net(x)
    net.task = 2
    before = net(x)
    path = tmp_path / "c.safetensors"
    gb.save(path, net.gparams, net.plan)
    gparams, plan, *_ = gb.load(path, model)
    assert plan.tasks == 4
    assert torch.equal(gparams["tasks"], net.tasks.detach())
    assert all(t.requires_grad for t in gb.trainable_leaves(gparams))  # the embeddings train
    again = gb.Bottleneck.from_checkpoint(path, model)
    again.task = 2
    torch.testing.assert_close(again(x), before)
    dense = net.export()
    torch.testing.assert_close(functional_call(model, dense, (x,)), before.detach())
    other = gb.export(gparams, plan, task=0)
    assert not torch.equal(other["0.weight"], dense["0.weight"])
    # One task's (or one condition's) dense model as a plain safetensors file.
    gb.save_dense(tmp_path / "task2.safetensors", gparams, plan, model=model, task=2)
    written = safetensors.torch.load_file(tmp_path / "task2.safetensors")
    torch.testing.assert_close(functional_call(model, written, (x,)), before.detach())
    z = gparams["tasks"][0].detach()
    gb.save_dense(tmp_path / "z.safetensors", gparams, plan, model=model, condition=z)
    written = safetensors.torch.load_file(tmp_path / "z.safetensors")
    torch.testing.assert_close(written["0.weight"], other["0.weight"])
    assert gb.report(plan).task_params == 12
    assert gb.report(plan).stored_params == gb.report(
        gb.plan(model, tile=(4, 4), hidden=5)
    ).stored_params + 12 + sum(s.num_gnets * 15 for s in plan.stacks)
    groups = gb.optim.param_groups(gparams, plan, free_lr=1e-3)
    (rate,) = [g["lr"] for g in groups if any(p is gparams["tasks"] for p in g["params"])]
    assert rate == 3 * gb.optim.GNET_LR["relu"]  # fan-ins 12 and 10: `fan_in_factor` 3
    assert gb.trainable_leaves(gparams)[-1] is gparams["tasks"]
    state = gb.optim.adamw_init(gparams)
    grads = grad(lambda g: functional_call(model, gb.apply(g, plan, task=1), (x,)).sum())(gparams)
    stepped, _ = gb.optim.adamw_update(gparams, grads, state, lr=0.1)
    assert not torch.equal(stepped["tasks"][1], gparams["tasks"][1])
    assert torch.equal(stepped["tasks"][0], gparams["tasks"][0])


def test_plans_without_a_condition_keep_their_json_and_conditioned_ones_round_trip():
    plain = gb.plan(mlp(), tile=(4, 4), hidden=5)
    assert "condition" not in plan_to_json(plain)
    assert "tasks" not in plan_to_json(plain)
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=2)
    back = plan_from_json(plan_to_json(plan))
    assert back == plan
    assert back.fingerprint() == plan.fingerprint()
    assert back.condition == 3
    assert back.tasks == 2
    assert plan.fingerprint() != plain.fingerprint()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda g, p, q: gb.apply(g, p), r"condition of width 3: pass condition="),
        (lambda g, p, q: gb.apply(g, p, condition=torch.ones(4)), r"shape \(4,\) .* \(3,\)"),
        (lambda g, p, q: gb.apply(g, p, task=4), r"task must be an int in 0\.\.3"),
        (lambda g, p, q: gb.apply(g, p, task=torch.tensor(1.0)), r"0-d integer tensor"),
        (lambda g, p, q: gb.apply(g, p, task=torch.tensor(True)), r"0-d integer tensor"),
        # eager, on the CPU: read and checked (it raised torch's bare IndexError)
        (
            lambda g, p, q: gb.apply(g, p, task=torch.tensor(4)),
            r"task must be in 0\.\.3, got tensor\(4\)",
        ),
        (lambda g, p, q: gb.apply(g, p, task=1, condition=torch.ones(3)), "not both"),
        # a vmapped batch of ids, on the CPU, is read and checked too (torch's bare error)
        (
            lambda g, p, q: vmap(lambda t: gb.apply(g, p, task=t))(torch.tensor([0, 4])),
            r"task must be in 0\.\.3, got tensor\(4\)",
        ),
        (
            lambda g, p, q: vmap(lambda t: gb.apply(g, p, task=t))(torch.tensor([-1, 2])),
            r"task must be in 0\.\.3, got tensor\(-1\)",
        ),
        (  # "Cannot copy out of meta tensor"
            lambda g, p, q: gb.apply(g, p, task=torch.tensor(1, device="meta")),
            r"gb.apply: task is on meta \(no value\) but gparams\['tasks'\] is on cpu",
        ),
        (
            lambda g, p, q: gb.apply(g, p, condition=torch.ones(3, device="meta")),
            r"gb.apply: condition is on meta but the g-nets of stack 's0_4x4' that read it are "
            "on cpu",
        ),
        (  # the task embeddings on meta gave the zero condition's weights without a word
            lambda g, p, q: gb.apply({**g, "tasks": g["tasks"].to("meta")}, p, task=1),
            r"gb.apply: gparams\['tasks'\] is on meta but the g-nets of stack",
        ),
        (lambda g, p, q: gb.apply(gb.init(q), q, condition=torch.ones(3)), "read no condition"),
        (  # check=True passed it, and every weight came out NaN
            lambda g, p, q: gb.apply(
                g, p, condition=torch.tensor([0, float("nan"), 0]), check=True
            ),
            r"^gb.apply: condition holds NaN or inf \(check=True\)",
        ),
        (
            lambda g, p, q: gb.plan(mlp(), condition=2, tasks=3, overrides={"*": {"condition": 0}}),
            "needs a condition",
        ),
        (
            lambda g, p, q: gb.plan(mlp(), condition=2, overrides={"2.*": {"condition": 3}}),
            r"widths \[2, 3\]",
        ),
        (lambda g, p, q: gb.plan(mlp(), condition=-1), "condition"),
        (
            lambda g, p, q: gb.apply({**g, "tasks": g["tasks"][:2]}, p, task=0),
            r"gparams\['tasks'\] has shape \(2, 3\); expected \(4, 3\)",
        ),
    ],
)
def test_bad_conditions_are_refused_with_the_argument_named(call, message):
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    plain = gb.plan(mlp(), tile=(4, 4), hidden=5)
    with pytest.raises((ValueError, TypeError), match=message):
        call(gb.init(plan), plan, plain)


def test_a_task_of_the_wrong_kind_is_a_type_error_and_one_out_of_range_a_value_error():
    # (a bool, a float, a string and float or bool tensors raised ValueError, as 4 does)
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    gparams = gb.init(plan)
    for task in (True, 1.5, "1", torch.tensor(1.0), torch.tensor(True)):
        with pytest.raises(TypeError, match=r"^gb\.apply: task must be an int"):
            gb.apply(gparams, plan, task=task)
    for task in (4, -1, torch.tensor([0, 1])):
        with pytest.raises(ValueError, match=r"^gb\.apply: task must be"):
            gb.apply(gparams, plan, task=task)
    with pytest.raises(TypeError, match=r"^gb\.apply: task must be an int in 0\.\.3, got True"):
        gb.apply(gparams, plan, task=True, compile=True)  # the graph path reads it itself


def test_a_task_may_be_any_integer_number_or_0d_integer_tensor():
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    gparams = gb.init(plan)
    with torch.no_grad():
        gparams["tasks"].normal_()
    want = gb.apply(gparams, plan, task=2)
    # numpy's integers, as everywhere in gbfunc; tensors of the narrow integer dtypes, which
    # index_select refused with torch's message (eager) and gather under vmap
    for task in (
        np.int64(2),
        torch.tensor(2, dtype=torch.uint8),
        torch.tensor(2, dtype=torch.int16),
    ):
        close(gb.apply(gparams, plan, task=task), want)
    batched = vmap(lambda t: gb.apply(gparams, plan, task=t))(torch.arange(4, dtype=torch.uint8))
    close({k: v[2] for k, v in batched.items()}, want)
    close(gb.export(gparams, plan, task=np.int64(2)), want)
    # under grad a task tensor is one id, read and range-checked (torch's IndexError before)
    with pytest.raises(ValueError, match=r"^gb\.apply: task must be in 0\.\.3, got tensor\(7\)"):
        grad(lambda g: gb.apply(g, plan, task=torch.tensor(7))["0.weight"].sum())(gparams)
    net = gb.Bottleneck(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    net.task = np.int64(3)
    assert net.task == 3
    assert type(net.task) is int


def test_a_bottlenecks_task_and_condition_survive_to_empty_type_and_to():
    x = torch.randn(2, 12)
    net = gb.Bottleneck(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    with torch.no_grad():
        net.tasks.normal_()
        for name, p in net.named_parameters():
            if name.endswith("w_cond"):
                p.normal_()
    net.task = 2
    want = net(x)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    net.to_empty(device="cpu")  # it left the task's index as uninitialised memory
    net.load_state_dict(state)
    torch.testing.assert_close(net(x), want)
    net.double()  # it made the index a float64 tensor, which gb.apply refuses
    torch.testing.assert_close(net(x.double()), want.double())
    net.float()
    net.task = None
    net.condition = torch.randn(3)
    net.to("meta")  # the condition stayed behind on the CPU
    assert net.condition.device.type == "meta"
    assert net(x.to("meta")).device.type == "meta"


def test_task_without_embeddings_asks_for_tasks():
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3)
    with pytest.raises(ValueError, match=r"task= needs learned task embeddings"):
        gb.apply(gb.init(plan), plan, task=0)


def test_the_dynamic_example_runs_each_input_through_its_own_weights():
    from examples import dynamic

    model = dynamic.classifier()
    plan = dynamic.plan_for(model, dynamic.WIDTH)
    gparams = conditioned(plan)
    z, x = torch.randn(3, dynamic.WIDTH), torch.rand(3, 1, 8, 8)
    logits = dynamic.per_input_logits(model, plan, gparams, z, x)
    for i in range(3):
        own = functional_call(model, gb.apply(gparams, plan, condition=z[i]), (x[i],))
        torch.testing.assert_close(logits[i], own)
    accuracy, params = dynamic.train(dynamic=True, steps=2)
    assert 0 <= accuracy <= 1
    assert params == gb.report(plan).stored_params + 64 * dynamic.WIDTH + dynamic.WIDTH


def test_bench_condition_times_the_same_weights_and_gradients_both_ways():
    from benchmarks import bench_condition

    (_, plan), *_ = bench_condition.models().values()
    gparams = conditioned(plan)
    zs = torch.randn(4, bench_condition.WIDTH, requires_grad=True)
    grads = []
    for name, run in bench_condition.contenders(gparams, plan, zs, backward=True).items():
        run()
        grads.append(
            (name, zs.grad.clone(), [t.grad.clone() for t in gb.trainable_leaves(gparams)])
        )
        zs.grad = None
        for leaf in gb.trainable_leaves(gparams):
            leaf.grad = None
    (_, z_vmap, leaves_vmap), (_, z_loop, leaves_loop) = grads
    torch.testing.assert_close(z_vmap, z_loop, rtol=1e-4, atol=1e-5)
    for a, b in zip(leaves_vmap, leaves_loop, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_continual_penalty_is_zero_at_its_targets_and_pulls_back_to_them():
    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=3, tasks=3)
    gparams = conditioned(plan)
    earlier = gb.continual.targets(gparams, plan, tasks=[0, 1])
    assert sorted(earlier) == [0, 1]
    assert gb.continual.penalty(gparams, plan, earlier).detach().item() == 0
    assert gb.continual.penalty(gparams, plan, {}).detach().item() == 0
    with torch.no_grad():
        gparams["tasks"][1] += 0.5
    moved = gb.continual.penalty(gparams, plan, earlier, strength=2.0)
    by_hand = sum(
        (gb.apply(gparams, plan, task=1)[k] - earlier[1][k]).square().sum() for k in earlier[1]
    )
    torch.testing.assert_close(moved, 2.0 * by_hand / 2)
    (g,) = torch.autograd.grad(moved, gparams["tasks"])
    assert bool(g[1].abs().sum() > 0)
    assert bool((g[0] == 0).all())
    assert bool((g[2] == 0).all())
    with pytest.raises(ValueError, match=r"task must be an int in 0\.\.2, got 3"):
        gb.continual.targets(gparams, plan, tasks=[3])
    by_numpy = gb.continual.targets(gparams, plan, tasks=[np.int64(1)])  # as gb.apply takes
    assert gb.continual.penalty(gparams, plan, by_numpy).detach().item() < 1e-10
    # tensors, as iterating torch.arange gives (refused as "an int in 0..2, got tensor(0)")
    by_tensor = gb.continual.targets(gparams, plan, tasks=torch.arange(2))
    assert sorted(by_tensor) == [0, 1]
    keyed = {torch.tensor(1): earlier[1]}  # task 0 added nothing to `moved`, the mean of two
    torch.testing.assert_close(gb.continual.penalty(gparams, plan, keyed, strength=2.0), 2 * moved)
    with pytest.raises(TypeError, match=r"task must be an int in 0\.\.2, got tensor\(1\.\)"):
        gb.continual.targets(gparams, plan, tasks=torch.ones(1))
    with pytest.raises(ValueError, match="strength"):
        gb.continual.penalty(gparams, plan, earlier, strength=-1)
    plain = gb.plan(model, tile=(4, 4), hidden=5, condition=3)
    with pytest.raises(ValueError, match="no task embeddings"):
        gb.continual.targets(gb.init(plain), plain, tasks=[0])
    # A missing entry raised a bare KeyError; a (1, n) one broadcast into a wrong penalty.
    short = {1: {k: v for k, v in earlier[1].items() if k != "0.weight"}}
    flat = {1: dict(earlier[1], **{"0.weight": earlier[1]["0.weight"][:1]})}
    for bad, got in ((short, "None"), (flat, r"shape \(1, 12\)")):
        with pytest.raises(
            ValueError, match=rf"^gb\.continual\.penalty: targets\[1\]\['0\.weight'\] .* got {got}"
        ):
            gb.continual.penalty(gparams, plan, bad)
    with pytest.raises(TypeError, match=r"targets must map task ids .* got list"):
        gb.continual.penalty(gparams, plan, [earlier[1]])
    as_numpy = {1: dict(earlier[1], **{"0.weight": np.zeros((100, 100))})}
    with pytest.raises(ValueError, match=r"(?s)got array\(.{0,100}; take targets") as raised:
        gb.continual.penalty(gparams, plan, as_numpy)
    assert len(str(raised.value)) < 400  # the whole array's repr was in it
    with pytest.raises(TypeError, match=r"tasks must be an iterable .* got int"):
        gb.continual.targets(gparams, plan, tasks=1)
    with pytest.raises(TypeError, match=r"tasks must be an iterable .* 0-d tensor: one id"):
        gb.continual.targets(gparams, plan, tasks=torch.tensor(1))


def test_the_continual_penalty_leaves_a_frozen_mask_out():
    """A frozen bool parameter never moves; subtracting two bool tensors raised."""
    model = mlp()
    model.register_parameter("mask", nn.Parameter(torch.ones(3, dtype=torch.bool), False))
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=3, tasks=2)
    gparams = conditioned(plan)
    earlier = gb.continual.targets(gparams, plan, tasks=[0])
    assert earlier[0]["mask"].dtype == torch.bool
    with torch.no_grad():
        gparams["tasks"][0] += 0.5
    moved = gb.continual.penalty(gparams, plan, earlier)
    floats = [k for k in earlier[0] if k != "mask"]
    by_hand = sum(
        (gb.apply(gparams, plan, task=0)[k] - earlier[0][k]).square().sum() for k in floats
    )
    torch.testing.assert_close(moved, gb.continual.STRENGTH * by_hand)


@needs_loops
def test_compiled_vmap_over_conditions_gives_each_conditions_weights():
    """`torch.compile(vmap(gb.apply))` over conditions, for a plan the C loops take, gives
    each condition's weights. (With leaves that require grad it fails: dynamo's template of
    the loops' autograd Function has no vmap rule, torch 2.13; a known limit.)"""
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, tile=(16, 16), hidden=8, outputs=16, condition=2)
    gparams = conditioned(plan)
    gparams = torch.utils._pytree.tree_map(lambda t: t.detach(), gparams)
    zs = torch.randn(3, 2)

    def weights(gparams, zs):
        return vmap(lambda z: gb.apply(gparams, plan, condition=z))(zs)

    got = torch.compile(weights, fullgraph=True)(gparams, zs)
    for i, z in enumerate(zs):
        close({k: v[i] for k, v in got.items()}, naive_apply(gparams, plan, z))


@pytest.mark.slow
def test_a_task_id_out_of_range_under_torch_compile_raises_or_gives_nan_under_vmap():
    """Compiled CPU code indexing the task table out of range aborted the process
    (std::terminate): now the graph raises; under `vmap`, which has no rule for that
    assertion, the bad id's weights are NaN and the others' as eager."""
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3, tasks=4)
    gparams = torch.utils._pytree.tree_map(lambda t: t.detach(), conditioned(plan))
    one = torch.compile(lambda t: gb.apply(gparams, plan, task=t)["0.weight"], fullgraph=True)
    close({"w": one(torch.tensor(2))}, {"w": gb.apply(gparams, plan, task=2)["0.weight"]})
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match=r"gb\.apply: task must be in 0\.\.3"):
            one(torch.tensor(bad))
    many = torch.compile(vmap(lambda t: gb.apply(gparams, plan, task=t)["0.weight"]))
    got = many(torch.tensor([1, 9]))
    torch.testing.assert_close(got[0], gb.apply(gparams, plan, task=1)["0.weight"])
    assert bool(got[1].isnan().all())


def test_a_sharded_checkpoint_keeps_the_task_embeddings_and_their_optimizer_state(tmp_path):
    import gbfunc.dist as gbd

    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, condition=3, tasks=2)
    gparams = conditioned(plan)
    opt = torch.optim.Adam(gb.optim.param_groups(gparams, plan, free_lr=1e-3))
    functional_call(model, gb.apply(gparams, plan, task=1), (torch.randn(2, 12),)).sum().backward()
    opt.step()
    gbd.save_sharded(tmp_path / "ckpt", gparams, plan=plan, optimizer=opt, step=1)
    fresh = gb.init(plan, seed=5)
    again = torch.optim.Adam(gb.optim.param_groups(fresh, plan, free_lr=1e-3))
    loaded = gbd.load_sharded(tmp_path / "ckpt", model, into=fresh, optimizer=again)
    assert loaded.plan.tasks == 2
    assert torch.equal(fresh["tasks"], gparams["tasks"].detach())
    torch.testing.assert_close(
        again.state[fresh["tasks"]]["exp_avg"], opt.state[gparams["tasks"]]["exp_avg"]
    )


def test_calibrate_and_fit_take_the_condition_their_weights_are_for():
    model = mlp()
    plan = gb.plan(model, tile=(4, 4), hidden=5, biases=True, condition=3, tasks=2)
    gparams, x = conditioned(plan), torch.randn(64, 12)

    def first_layer_mean(gparams: dict, task: int) -> float:
        params = gb.apply(gparams, plan, task=task)
        return (x @ params["0.weight"].T + params["0.bias"]).mean().item()

    with pytest.raises(ValueError, match=r"^gb\.calibrate: .*task"):
        gb.calibrate(gparams, plan, model, x)
    assert abs(first_layer_mean(gparams, 1)) > 1e-2
    calibrated = gb.calibrate(gparams, plan, model, x, task=1)
    assert abs(first_layer_mean(calibrated, 1)) < 1e-4  # generated bias: one shift per layer

    with pytest.raises(ValueError, match=r"^gb\.fit: .*task"):
        gb.fit(gparams, plan, model.state_dict(), steps=1)
    fitted = gb.fit(gparams, plan, model.state_dict(), steps=60, task=1)
    assert torch.equal(fitted.gparams["tasks"], gparams["tasks"])  # kept as they are
    assert fitted.gparams["tasks"].requires_grad
    start = gb.fit(gparams, plan, model.state_dict(), steps=1, lr=1e-12, task=1).errors
    assert sum(fitted.errors.values()) < 0.5 * sum(start.values())
    error = gb.apply(fitted.gparams, plan, task=1)["0.weight"] - model[0].weight
    relative = error.square().mean() / model[0].weight.square().mean()
    assert relative.item() == pytest.approx(fitted.errors["0.weight"], rel=1e-4)

    net = gb.Bottleneck(mlp(), tile=(4, 4), hidden=5, biases=True, condition=3, tasks=2)
    net.load_gparams(conditioned(net.plan))
    net.task = 1
    net.calibrate(x)
    assert abs(first_layer_mean(net.gparams, 1)) < 1e-4


def test_a_bottleneck_task_set_during_evaluation_trains_after():
    """The task's index was made when set: under `inference_mode` (an evaluation loop over the
    tasks) an inference tensor, which the next training call could not save for backward."""
    torch.manual_seed(0)
    net = gb.Bottleneck(
        nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)),
        tile=(8, 8),
        condition=8,
        tasks=3,
    )
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for task in range(3):
            net.task = task
            net(x)
    net(x).square().sum().backward()
    assert net.tasks.grad is not None


def test_a_condition_of_another_float_dtype_is_taken_in_the_gnets_dtype():
    plan = gb.plan(mlp(), tile=(4, 4), hidden=5, condition=3)
    gparams = gb.init(plan)  # float32 g-nets
    z = torch.randn(3, dtype=torch.float64)
    weights = gb.apply(gparams, plan, condition=z)
    assert weights["0.weight"].dtype == torch.float32
    torch.testing.assert_close(weights, gb.apply(gparams, plan, condition=z.float()))


def test_continual_targets_are_copies_that_in_place_training_does_not_move():
    plan = gb.plan(mlp(16, 8, 2), tile="full", hidden=4, condition=4, tasks=3)
    gparams = gb.init(plan)
    earlier = gb.continual.targets(gparams, plan, tasks=[0, 1])
    with torch.no_grad():
        gparams["free"]["0.bias"].add_(1.0)  # an optimizer's step, in place
    assert gb.continual.penalty(gparams, plan, earlier).item() > 0


def test_the_report_gives_the_task_tables_shape_tasks_by_condition():
    report = gb.report(gb.plan(mlp(16, 8, 2), tile="full", hidden=4, condition=4, tasks=3))
    assert report.task_shape == (3, 4)
    assert "3x4" in str(report)
