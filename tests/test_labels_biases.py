"""Neuron labels (one-hot, grids of Gray-coded coordinates) and generated biases: the
paper's genome (Shuvaev et al. 2024) through `gb.plan` options."""

import math

import pytest
import torch
from devices import KERNEL_DEVICE
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc._genome import labels_code, labels_width


def paper_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 10))


PAPER = {
    "tile": "full",
    "encoding": "gray",
    "hidden": 8,
    "biases": True,
    "overrides": {"1.weight": {"col_labels": (8, 8)}, "3.*": {"row_labels": "onehot"}},
}


def test_label_codes_follow_their_definitions():
    torch.testing.assert_close(
        labels_code(4, "onehot", "gray", 4), torch.eye(4, dtype=torch.float64)
    )
    # A (2, 3) grid, Gray-coded: index 5 is cell (1, 2) -> gray(1) = 1 (1 bit), gray(2) = 0b11.
    grid = labels_code(6, (2, 3), "gray", 4)
    assert grid.shape == (6, 3)
    assert grid[5].tolist() == [1.0, 1.0, 1.0]
    assert grid[4].tolist() == [1.0, 0.0, 1.0]  # cell (1, 1): gray(1) = 0b01
    assert grid[2].tolist() == [0.0, 1.0, 1.0]  # cell (0, 2)
    binary = labels_code(6, (2, 3), "binary", 4)
    assert binary[5].tolist() == [1.0, 1.0, 0.0]  # binary(2) = 0b10


@pytest.mark.parametrize("encoding", ["binary", "gray", "fourier"])
@pytest.mark.parametrize("labels", ["position", "onehot", (5, 5), (3, 4), (2, 3, 4)])
def test_label_widths_are_the_widths_of_their_codes(labels, encoding):
    """The plan sizes g-nets by `labels_width`; it must be the code's own width, per dim."""
    n = 25 if labels in ("position", "onehot") else math.prod(labels)
    code = labels_code(n, labels, encoding, 3)
    assert code.shape == (n, labels_width(n, labels, encoding, 3))


def test_a_grid_that_does_not_cover_the_neurons_is_named():
    with pytest.raises(ValueError, match=r"^labels: grid \(3, 4\) has 12 cells for 10 neurons\.$"):
        labels_code(10, (3, 4), "gray", 4)


def test_genome_labels_given_as_lists_become_tuples():
    """A frozen, hashable genome: `[8, 8]` (e.g. from JSON) is stored as `(8, 8)`."""
    genome = gb.Genome(row_labels=[4, 2], col_labels=[8, 8])
    assert (genome.row_labels, genome.col_labels) == ((4, 2), (8, 8))
    assert hash(genome) == hash(gb.Genome(row_labels=(4, 2), col_labels=(8, 8)))


def test_the_papers_genome_is_one_gnet_per_weight_and_bias():
    model = paper_mlp()
    plan = gb.plan(model, **PAPER)
    assert [p.name for p in plan.generated] == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert not plan.free
    widths = {s.key: (s.row_width, s.col_width) for s in plan.stacks}
    # Rows of layer 1: binary positions of 40 neurons (6 bits, Gray); columns: 3 + 3 bits of
    # the pixel's (y, x); layer 3's rows: one-hot classes.
    assert widths[plan.stacks[plan.generated[0].stack_index].key] == (6, 6)
    assert widths[plan.stacks[plan.generated[2].stack_index].key] == (10, 6)
    assert widths[plan.stacks[plan.generated[3].stack_index].key][0] == 10
    params = gb.apply(gb.init(plan), plan)
    own = dict(model.named_parameters())
    for name, value in params.items():
        assert value.shape == own[name].shape
        assert value.std().item() == pytest.approx(own[name].std().item(), rel=0.25), name
    out = functional_call(model, params, (torch.rand(3, 1, 8, 8),))
    assert out.shape == (3, 10)


def test_generated_biases_get_gradients_and_match_the_triton_kernels():
    pytest.importorskip("triton")
    model = paper_mlp().to(KERNEL_DEVICE)
    plan = gb.plan(model, **PAPER)
    gparams = gb.init(plan, device=KERNEL_DEVICE)
    x = torch.rand(5, 1, 8, 8, device=KERNEL_DEVICE)

    def loss(g, backend):
        return functional_call(model, gb.apply(g, plan, backend=backend), (x,)).square().mean()

    ours = torch.func.grad(loss)(gparams, "torch")
    fused = torch.func.grad(loss)(gparams, "triton")
    bias_stack = plan.stacks[plan.generated[1].stack_index].key
    assert ours["stacks"][bias_stack]["w_out"].abs().sum() > 0
    for a, b in zip(
        torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(fused), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_biases_stay_free_unless_asked():
    plan = gb.plan(paper_mlp(), tile=(8, 8))
    reasons = {p.name: p.reason for p in plan.free}
    assert reasons["1.bias"] == "bias (pass biases=True to generate)"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tile": (8, 8), "row_labels": "onehot"}, "row_labels='onehot'.*tile"),
        ({"tile": "full", "overrides": {"1.weight": {"col_labels": (7, 9)}}}, r"\(7, 9\).*64"),
        ({"tile": "full", "outputs": 2, "col_labels": (8, 8)}, "outputs=2"),
        ({"tile": "full", "row_labels": "rows"}, "row_labels must be one of"),
        ({"tile": "full", "col_labels": (8, 0)}, "col_labels must be one of"),
        ({"tile": "full", "biases": 1}, "biases must be a bool"),
    ],
)
def test_bad_labels_name_the_parameter_and_option(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        gb.plan(paper_mlp(), **options)


def test_labels_survive_a_checkpoint(tmp_path):
    model = paper_mlp()
    plan = gb.plan(model, **PAPER)
    gparams = gb.init(plan)
    gb.save(tmp_path / "p.safetensors", gparams, plan)
    loaded = gb.load(tmp_path / "p.safetensors", model)
    assert loaded.plan == plan
    torch.testing.assert_close(gb.apply(loaded.gparams, plan), gb.apply(gparams, plan))


def test_centred_rows_sum_to_zero_on_both_backends():
    pytest.importorskip("triton")
    model = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 4))
    plan = gb.plan(model, tile=(8, 8), center=True, biases=True, activation="tanh")
    assert all(p.center == (len(p.shape) > 1) for p in plan.generated)
    gparams = gb.init(plan, device=KERNEL_DEVICE)
    ours = gb.apply(gparams, plan, backend="torch")
    fused = gb.apply(gparams, plan, backend="triton")
    for name in ("0.weight", "2.weight"):
        torch.testing.assert_close(
            ours[name].sum(1), torch.zeros_like(ours[name][:, 0]), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(fused[name], ours[name], atol=1e-6, rtol=1e-5)
    uncentred = gb.apply(gb.init(gb.plan(model, tile=(8, 8))), gb.plan(model, tile=(8, 8)))
    assert uncentred["0.weight"].sum(1).abs().max() > 1e-3  # the option is what centres


def test_centred_weights_cannot_be_split_by_columns_in_dist():
    from gbfunc.dist import Selection

    plan = gb.plan(nn.Linear(16, 8), tile=(4, 4), center=True)
    Selection(plan, {"weight": ((0, 4), (0, 16))})  # whole rows: fine
    with pytest.raises(ValueError, match="center=True, which needs whole rows"):
        Selection(plan, {"weight": ((0, 8), (0, 8))})
    with pytest.raises(TypeError, match="center must be a bool"):
        gb.plan(nn.Linear(16, 8), center="yes")
