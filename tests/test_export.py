"""gb.export / gb.save_dense: an ordinary state_dict that loads strictly and computes the same."""

import pytest
import safetensors.torch
import torch
from tiny_gpt2 import tiny_gpt2_config
from torch import nn
from torch.func import functional_call

import gbfunc as gb


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)
    )


def trained(model: nn.Module, **kwargs) -> tuple[dict, gb.Plan]:
    """gparams after one optimizer step, so that nothing is at its init value."""
    plan = gb.plan(model, **kwargs)
    gparams = gb.init(plan, seed=2)
    leaves = [t for s in gparams["stacks"].values() for t in s.values()] + list(
        gparams["free"].values()
    )
    opt = torch.optim.SGD(leaves, lr=0.1)
    x = torch.randn(4, *_input_shape(model))
    functional_call(model, gb.apply(gparams, plan), (x,)).square().mean().backward()
    opt.step()
    return gparams, plan


def _input_shape(model: nn.Module) -> tuple[int, ...]:
    return (3, 8, 8) if isinstance(model[0], nn.Conv2d) else (model[0].in_features,)


def test_export_without_model_is_the_plan_parameters_detached():
    model = nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3))
    gparams, plan = trained(model, tile=(4, 4))
    sd = gb.export(gparams, plan)
    params = gb.apply(gparams, plan)
    assert list(sd) == [p.name for p in plan.params]
    for name, value in sd.items():
        assert not value.requires_grad
        assert value.dtype == torch.float32
        assert torch.equal(value, params[name])
    sd["0.bias"].add_(1.0)  # a copy: gparams are untouched
    assert not torch.equal(sd["0.bias"], gparams["free"]["0.bias"])


def test_export_with_model_loads_strictly_with_buffers_and_same_outputs(tmp_path):
    model = cnn()
    gparams, plan = trained(model, tile=(4, 3))
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    want = functional_call(model, gb.apply(gparams, plan), (x,))

    sd = gb.export(gparams, plan, model=model)
    assert list(sd) == list(model.state_dict())  # running stats and num_batches_tracked too
    fresh = cnn().eval()
    fresh.load_state_dict(sd, strict=True)
    torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)

    gb.save_dense(tmp_path / "m.safetensors", gparams, plan, model=model, metadata={"note": "cnn"})
    other = cnn().eval()
    other.load_state_dict(safetensors.torch.load_file(tmp_path / "m.safetensors"), strict=True)
    torch.testing.assert_close(other(x), want, rtol=0, atol=0)
    with safetensors.safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "cnn"}


def test_export_casts_to_the_model_dtype():
    model = nn.Linear(6, 4)
    plan = gb.plan(model, tile=(2, 2))
    sd = gb.export(gb.init(plan, dtype=torch.float64), plan, model=model)
    assert {v.dtype for v in sd.values()} == {torch.float32}
    model.load_state_dict(sd, strict=True)


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config(transformers)
    return transformers, config


def test_gpt2_generated_weights_export_into_a_fresh_model_and_transformers(
    gpt2, tmp_path, monkeypatch
):
    transformers, config = gpt2
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    # Conv1D weights and the tied wte/lm_head are generated; wte appears once in the plan.
    plan = gb.plan(model, tile=(16, 16), embeddings=True)
    names = [p.name for p in plan.generated]
    assert "transformer.h.0.attn.c_attn.weight" in names
    assert "transformer.wte.weight" in names
    assert "lm_head.weight" not in [p.name for p in plan.params]
    gparams = gb.init(plan, seed=1)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        want = functional_call(model, gb.apply(gparams, plan), (ids,)).logits

    sd = gb.export(gparams, plan, model=model)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    fresh = transformers.GPT2LMHeadModel(config).eval()
    fresh.load_state_dict(sd, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, want, rtol=0, atol=0)

    # The same weights served by transformers' own loader, from a local folder.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config.save_pretrained(tmp_path)
    gb.save_dense(tmp_path / "model.safetensors", gparams, plan, model=model)
    served = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, want, rtol=0, atol=0)


def test_a_model_on_meta_with_buffers_is_refused_by_name(tmp_path):
    """Its buffers have no values: exported as they were, the state dict could not be loaded,
    and gb.save_dense failed with torch's 'Cannot copy out of meta tensor'."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    plan = gb.plan(model, tile=(4, 3))
    gparams = gb.init(plan)
    with pytest.raises(ValueError, match=r"^gb\.export: the model's '1\.running_mean' is on the"):
        gb.export(gparams, plan, model=model)
    # Named for the call made (gb.save_dense's errors said gb.export).
    with pytest.raises(ValueError, match=r"^gb\.save_dense: the model's '1\.running_mean'"):
        gb.save_dense(tmp_path / "dense.safetensors", gparams, plan, model=model)
    assert not (tmp_path / "dense.safetensors").exists()
    assert set(gb.export(gparams, plan)) == {p.name for p in plan.params}  # no model: fine


def _table_model(table: dict) -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4, **table), nn.Linear(4, 8))


@pytest.mark.parametrize(
    ("table", "reason"),
    [
        ({"padding_idx": 0}, "embedding with padding_idx=0, whose row must stay zero"),
        ({"padding_idx": -1}, "embedding with padding_idx=9, whose row must stay zero"),
        ({"max_norm": 1.0}, "embedding with max_norm=1.0, which renormalises the table in place"),
        ({"sparse": True}, "embedding with sparse=True, whose gradient is sparse"),
    ],
)
def test_padding_and_max_norm_tables_stay_free_and_export_as_their_module_keeps_them(table, reason):
    """Issue 53, row 8: with `embeddings=True` such a table was generated, its padding row
    non-zero, and `gb.export` handed that to the dense model. It stays free, `gb.report` says
    why, a padding row stays zero (copied, trained or drawn) and gets no gradient, and asking
    to generate it is refused."""
    torch.manual_seed(0)
    model = _table_model(table)
    plan = gb.plan(model, tile=(4, 4), embeddings=True)
    assert [p.name for p in plan.generated] == ["1.weight"]
    assert next(p for p in plan.free if p.name == "0.weight").reason == reason
    assert reason in str(gb.report(plan))
    gparams = gb.init(plan)
    ids = torch.tensor([0, 9, 3, 0])
    functional_call(model, gb.apply(gparams, plan), (ids,)).sum().backward()
    dense = gb.export(gparams, plan, model=model)
    assert torch.equal(dense["0.weight"], gparams["free"]["0.weight"])  # as looked up
    pad = model[0].padding_idx
    if pad is not None:
        assert not dense["0.weight"][pad].any()
        assert not gparams["free"]["0.weight"].grad[pad].any()
        with torch.device("meta"):
            blank = _table_model(table)
        drawn = gb.init(gb.plan(blank, tile=(4, 4), embeddings=True))["free"]["0.weight"]
        assert not drawn[pad].any()
        assert drawn.abs().sum(1).count_nonzero() == 9  # the other rows drawn
    with pytest.raises(ValueError, match=r"^gb\.plan: 0\.weight was asked to be generated, but"):
        gb.plan(model, tile=(4, 4), overrides={"0.weight": {"generate": True}})


def test_a_padded_tables_plan_round_trips_a_checkpoint(tmp_path):
    """The plan records how `gb.init` draws the table (`normal_padded` and its row), which
    `gb.load` reads back (`tests/test_checkpoint_files.py` refuses a row outside the table)."""
    model = _table_model({"padding_idx": 3})
    plan = gb.plan(model, tile=(4, 4), embeddings=True)
    assert plan.params[0].init == ("normal_padded", 3)
    gb.save(tmp_path / "c.safetensors", gb.init(plan), plan)
    assert gb.load(tmp_path / "c.safetensors", model).plan == plan


def test_the_exported_buffers_are_copies_of_the_models():
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    plan = gb.plan(model, tile=(8, 8))
    exported = gb.export(gb.init(plan), plan, model=model)
    kept = exported["1.running_mean"].clone()
    model.train()(torch.randn(8, 6) + 5)  # moves the model's statistics in place
    assert not torch.equal(model[1].running_mean, kept)
    assert torch.equal(exported["1.running_mean"], kept)
