"""`gb.plan(compression=...)`: what the tile search and the table sizing count and refuse."""

import re

import pytest
from torch import nn

import gbfunc as gb
from gbfunc._search import UnreachableError


def test_task_embeddings_are_counted_at_the_width_of_generated_layers_only():
    """A `condition` override on a bias left free made the search budget a (500, 32) task
    table the plan never stores: 6x came out 14.12x."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    with pytest.warns(UserWarning, match=r"overrides\['0\.bias'\] sets condition, but every "):
        plan = gb.plan(
            model, compression=6, condition=8, tasks=500, overrides={"0.bias": {"condition": 32}}
        )
    rep = gb.report(plan)
    assert rep.task_params == 500 * 8
    assert rep.compression == pytest.approx(6, rel=0.10)


@pytest.mark.parametrize("target", [3, 10])
def test_the_search_keeps_a_layer_that_reads_the_task_embeddings(target):
    """The search left the only conditioned layer free (its g-nets cost more than it under
    the tile found), and the plan then asked for the condition=<width> the caller gave."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    plan = gb.plan(model, compression=target, tasks=10, overrides={"2.weight": {"condition": 8}})
    assert "2.weight" in {p.name for p in plan.generated}
    assert gb.report(plan).compression == pytest.approx(target, rel=0.10)


def test_an_override_on_a_layer_the_search_frees_for_its_cost_is_not_said_to_change_nothing():
    """Its condition widens the g-nets whose cost left the layer free: "so they change
    nothing" was not so."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    plan = gb.plan(model, compression=10, overrides={"2.weight": {"condition": 8}})  # no warning
    reasons = {p.name: p.reason for p in plan.free}
    assert reasons["2.weight"] == "its g-nets would cost 3,045 parameters for 2,048"


def test_a_target_no_tile_can_give_a_layer_for_the_task_embeddings_says_so():
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))
    over = {"2.weight": {"condition": 8, "hidden": 64}}  # its g-nets outweigh it under any tile
    with pytest.raises(
        UnreachableError,
        match=r"under every tile the g-nets of the parameters that read the condition \(which "
        r"tasks= feeds\) cost more than those parameters.* share=True leaves the parameters "
        "that read the condition free under every tile",
    ):
        gb.plan(model, compression=10, tasks=10, overrides=over)


def test_auto_tables_that_step_over_the_target_are_unreachable():
    """One bucket more per shared 8x8 tile steps from 30.91x to 20.84x: 25x came out 20.84x
    without a word."""
    model = nn.Linear(512, 512, bias=False)
    options = {"share": True, "embed_dim": 1, "hashed": "auto", "compression_of": "generated"}
    with pytest.raises(
        UnreachableError,
        match=r"compression=25 cannot be reached within 10% by sizing the hashed tables: they "
        r"give 0\.98x \(a bucket per position\) to 30\.91x \(one per tile\), and the sizes on "
        r"either side of it give 30\.91x and 20\.84x\. Otherwise change hidden/tile",
    ):
        gb.plan(model, tile=(8, 8), compression=25, **options)
    # Without tile=, the next tile whose tables reach it (64x64 came out 17% over).
    plan = gb.plan(model, hidden=1, compression=1550, **options)
    assert [s.tile for s in plan.stacks] == [(128, 128)]
    assert gb.report(plan).generated_compression == pytest.approx(1550, rel=0.10)


@pytest.mark.parametrize(
    ("options", "target"),
    [
        ({"row_labels": "onehot"}, 2),
        ({"row_labels": "onehot"}, 6.5),
        ({"col_labels": (16, 16), "overrides": {"2.weight": {"col_labels": "position"}}}, 3),
        # tables sized on the tiles it tries
        (
            {
                "row_labels": (8, 16),
                "hashed": "auto",
                "overrides": {"2.*": {"row_labels": "position"}},
            },
            2,
        ),
    ],
)
def test_compression_keeps_an_axis_of_labelled_neurons_whole(options, target):
    """The search split a labelled axis, which the plan builder then refused."""
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    plan = gb.plan(model, compression=target, **options)
    for param in plan.generated:
        stack = plan.stacks[param.stack_index]
        if stack.genome.row_labels != "position":
            assert stack.tile[0] == param.shape[0], param.name
        if stack.genome.col_labels != "position":
            assert stack.tile[1] == param.shape[1], param.name
    assert gb.report(plan).compression == pytest.approx(target, rel=0.10)


def test_with_labelled_neurons_the_advice_names_options_that_reach_the_target():
    """The advice counted tiles that split a labelled axis: share=True "reached" 20x, and
    then its plan was refused."""
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    with pytest.raises(UnreachableError) as info:
        gb.plan(model, compression=5, row_labels="onehot")
    reaching = re.findall(
        r"(?:; |Searched again: )([^;]+?) gives [^;]+, which reaches", str(info.value)
    )
    assert reaching == ["biases=True, share=True", "share=True"]
    rep = gb.report(gb.plan(model, compression=5, row_labels="onehot", share=True))
    assert rep.compression == pytest.approx(5, rel=0.10)
    with pytest.raises(UnreachableError, match=r"share=True gives [\d.]+x to [\d.]+x\. "):
        gb.plan(model, compression=20, row_labels="onehot")


frozen = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
frozen[0].weight.requires_grad_(False)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (nn.Sequential(), r"gb\.plan: Sequential has no parameters to generate\."),
        (nn.LayerNorm(8), r"LayerNorm has no parameter to generate: every parameter is free \(no "),
        (
            frozen,
            r"every parameter is free \(bias \(pass biases=True to generate\); frozen \(requires_",
        ),
    ],
)
@pytest.mark.parametrize("options", [{}, {"compression": 2}, {"compression": 2, "hashed": "auto"}])
def test_compression_on_a_model_with_nothing_to_generate_says_why(model, match, options):
    """compression= said only "compression= has no parameter to choose a tile for"."""
    with pytest.raises(ValueError, match=match):
        gb.plan(model, **options)


def test_compression_with_every_tile_given_says_so():
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    with pytest.raises(
        ValueError,
        match=r"gb\.plan: compression= has no tile to choose: every generated parameter's tile "
        r"is given in overrides \(0\.weight, 2\.weight\); drop compression=, or one of those",
    ):
        gb.plan(model, compression=5, overrides={"*": {"tile": "full"}})
