"""gb.Bottleneck in the trainers of transformers, Lightning and Accelerate (the `integrations`
extra): each trains a few steps on synthetic data, the loss falls, and what they save is the
compressed model only."""

import os

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gbfunc as gb

VOCAB, SEQ = 64, 16


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 3))


def regression(rows: int = 64) -> TensorDataset:
    """A learnable target: a fixed random linear map of the inputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 12, generator=gen)
    return TensorDataset(x, x @ torch.randn(12, 3, generator=gen))


def falls(losses: list[float], window: int = 4) -> bool:
    """The mean of the last `window` losses (one epoch of 4 batches) is below 80% of the first's."""
    return sum(losses[-window:]) < 0.8 * sum(losses[:window])


# ---------------------------------------------------------------- transformers


class Counting(torch.utils.data.Dataset):
    """Token sequences that count up modulo 8 from a random start: next token is predictable.

    Each row also has a `source` column the model does not take: the Trainer has to drop it
    by reading the model's signature through `gb.Bottleneck.forward` (GPT-2 would raise on it).
    """

    def __init__(self, rows: int = 64) -> None:
        start = torch.randint(0, 8, (rows, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (start + torch.arange(SEQ)) % 8

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": "synthetic"}


@pytest.mark.slow
def test_transformers_trainer_trains_gpt2_and_saves_only_compressed_weights(tmp_path):
    """Default `TrainingArguments`: the Trainer keeps the columns GPT-2's forward names (and
    drops the others) because `gb.Bottleneck.forward` reports GPT-2's signature."""
    transformers = pytest.importorskip("transformers", reason="needs the integrations extra")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    b = gb.Bottleneck(model, tile=(32, 32), hidden=8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=12,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        # The Trainer reads label names from the class's forward, gbfunc's: without this,
        # evaluate() reported no loss (docs/training.md says so).
        label_names=["labels"],
    )  # remove_unused_columns keeps its default: only the columns forward names are passed
    trainer = transformers.Trainer(model=b, args=args, train_dataset=Counting())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 12
    assert falls(losses), losses
    assert trainer.evaluate(Counting(16))["eval_loss"] < losses[0]

    trainer.save_model(str(tmp_path / "final"))
    path = tmp_path / "final" / "model.safetensors"
    saved = safetensors.torch.load_file(path)
    assert set(saved) == set(b.state_dict())  # the g-nets and free parameters, nothing dense
    stored = sum(t.numel() for k, t in saved.items() if k != "_extra_state")  # the plan's
    assert stored == b.report().stored_params  # GPT-2 has no buffers in transformers 5
    dense = sum(p.numel() for p in model.parameters())
    assert os.path.getsize(path) < 0.5 * 4 * dense
    fresh = gb.Bottleneck(transformers.GPT2LMHeadModel(config), b.plan)
    fresh.load_state_dict(saved, strict=True)
    ids = Counting()[0]["input_ids"][None]
    b.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, b(ids).logits, rtol=0, atol=0)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="needs the integrations extra")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def test_the_bottleneck_answers_for_its_pnet_what_transformers_reads():
    """`b.generate` generates with the g-nets' weights (`b.pnet.generate` ran on the p-net's
    dense weights, which training never changes); `config` and the embeddings are the
    p-net's (the Trainer left GPT-2's KV cache on, and predict() crashed on it); a forward
    that accelerate wraps in autocast and binds again keeps GPT-2's signature (a later
    Trainer dropped `input_ids`); a state of another plan is refused, not half loaded."""
    import functools
    import inspect
    import types

    model = tiny_gpt2()
    b = gb.Bottleneck(model, tile=(16, 16), hidden=8)
    with torch.no_grad():
        for leaf in gb.trainable_leaves(b.gparams):
            leaf.add_(0.05 * torch.randn_like(leaf))  # as training would: away from the p-net
    ids = Counting()[0]["input_ids"][None, :6]
    b.eval()
    with torch.no_grad():
        last = b(ids).logits[:, -1]
        out = b.generate(ids, max_new_tokens=1, output_scores=True, return_dict_in_generate=True)
    torch.testing.assert_close(out.scores[0], last, rtol=1e-5, atol=1e-5)
    assert b.config is model.config
    assert b.main_input_name == "input_ids"
    assert b.get_input_embeddings() is model.get_input_embeddings()
    assert not hasattr(gb.Bottleneck(mlp(), tile=(4, 4)), "config")

    function = b.forward.__func__  # what accelerate's mixed precision does to `forward`

    @functools.wraps(function)
    def autocast_forward(*args, **kwargs):
        return function(*args, **kwargs)

    b.forward = types.MethodType(autocast_forward, b)
    assert "input_ids" in inspect.signature(b.forward).parameters
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits[:, -1], last)

    other = gb.Bottleneck(tiny_gpt2(), tile=(32, 32), hidden=8)
    with pytest.raises(ValueError, match=r"the state's g-net stacks are not this module's"):
        other.load_state_dict(gb.Bottleneck(tiny_gpt2(), tile=(16, 16)).state_dict(), strict=False)


def test_checkpointing_inside_the_pnet_is_refused_and_around_the_call_is_exact():
    """transformers' gradient checkpointing recomputed GPT-2's blocks in the backward pass with
    the model's own dense weights (functional_call had put them back): gradients off by 0.75,
    without a word. Checkpointing the whole call recomputes the generation too."""
    transformers = pytest.importorskip("transformers", reason="needs the integrations extra")
    from tiny_gpt2 import tiny_gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(transformers))
    b = gb.Bottleneck(model, tile=(16, 16), hidden=4)
    ids = Counting()[0]["input_ids"][None]
    with pytest.raises(ValueError, match="gradient checkpointing inside the p-net"):
        b.activation_checkpointing_enable()  # what Trainer(gradient_checkpointing=True) calls
    model.activation_checkpointing_enable()
    b.train()
    with pytest.raises(ValueError, match=r"checkpoint the whole call instead"):
        b(ids, labels=ids)
    model.activation_checkpointing_disable()
    b.eval()  # no dropout: the two backward passes see the same forward
    b(input_ids=ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in b.named_parameters()}
    b.zero_grad()
    whole = torch.utils.checkpoint.checkpoint(b, ids, labels=ids, use_reentrant=False)
    whole.loss.backward()
    for name, p in b.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], msg=name)


# ---------------------------------------------------------------- Lightning


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning:lightning.*")  # num_workers, log_every_n_steps
@pytest.mark.filterwarnings("ignore::FutureWarning:lightning.*")  # its use of torch's LeafSpec
def test_lightning_trainer_fits_a_module_around_it(tmp_path):
    L = pytest.importorskip("lightning", reason="needs the integrations extra")

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = gb.Bottleneck(mlp(), tile=(8, 8))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    module = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=16,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, DataLoader(regression(), batch_size=16, shuffle=False))
    assert len(module.losses) == 16
    assert falls(module.losses), module.losses
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert set(ckpt["state_dict"]) == {f"net.{k}" for k in module.net.state_dict()}


# ---------------------------------------------------------------- Accelerate


@pytest.mark.slow
def test_accelerate_prepares_and_trains_it(tmp_path):
    accelerate = pytest.importorskip("accelerate", reason="needs the integrations extra")
    accelerator = accelerate.Accelerator(cpu=True)
    b = gb.Bottleneck(mlp(), tile=(8, 8))
    opt = torch.optim.Adam(b.parameters(), lr=1e-2)
    loader = DataLoader(regression(), batch_size=16, shuffle=False)
    model, opt, loader = accelerator.prepare(b, opt, loader)
    losses = []
    for _ in range(4):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert falls(losses), losses
    assert accelerator.unwrap_model(model) is b
    accelerator.save_model(model, tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(b.state_dict())
