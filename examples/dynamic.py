"""A dynamic hypernetwork: each input gets weights of its own, generated from its features.

    python -m examples.dynamic              # about 20 s on one CPU core

An encoder maps each digits image (scikit-learn's 8x8 digits) to a condition vector `z`; one
conditioned genome (`gb.plan(..., condition=4)`) generates the classifier's weights for each
`z`, and `torch.func.vmap` runs every image through its own weights in one call. Beside it,
the same genome without a condition (one weight set for every image). Both train with Adam at
`gb.optim.param_groups`' default rates and print their validation accuracy and trainable
parameter counts.
"""

import argparse

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

import gbfunc as gb
from examples.data import digits_split

WIDTH = 4  # of the condition vector


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(0), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def plan_for(model: nn.Module, condition: int) -> gb.Plan:
    return gb.plan(model, tile="full", hidden=8, outputs=4, condition=condition)


def per_input_logits(
    model: nn.Module, plan: gb.Plan, gparams: dict, z: Tensor, x: Tensor
) -> Tensor:
    """Logits `(B, 10)`: image `x[i]` through the weights generated for `z[i]`, in one call."""

    def one(zi: Tensor, xi: Tensor) -> Tensor:
        return functional_call(model, gb.apply(gparams, plan, condition=zi), (xi,))

    return vmap(one)(z, x)


def train(dynamic: bool, steps: int, seed: int = 0) -> tuple[float, int]:
    """Train the dynamic (or the plain) genome; return validation accuracy and parameters."""
    x_train, y_train, x_val, y_val = digits_split(seed=seed)
    model = classifier()
    plan = plan_for(model, WIDTH if dynamic else 0)
    gparams = gb.init(plan, seed=seed)
    torch.manual_seed(seed)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, WIDTH), nn.Tanh())
    groups = gb.optim.param_groups(gparams, plan, free_lr=3e-3)
    if dynamic:
        groups.append({"params": list(encoder.parameters()), "lr": 3e-3})
    opt = torch.optim.Adam(groups)

    def logits(x: Tensor) -> Tensor:
        if dynamic:
            return per_input_logits(model, plan, gparams, encoder(x), x)
        return vmap(lambda xi: functional_call(model, gb.apply(gparams, plan), (xi,)))(x)

    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(len(x_train), (64,), generator=gen)
        loss = nn.functional.cross_entropy(logits(x_train[batch]), y_train[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (logits(x_val).argmax(1) == y_val).float().mean().item()
    params = gb.report(plan).stored_params
    params += sum(p.numel() for p in encoder.parameters()) if dynamic else 0
    return accuracy, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for dynamic in (True, False):
        accuracy, params = train(dynamic, args.steps)
        name = "per-input weights" if dynamic else "one weight set"
        print(f"{name:18s} validation accuracy {accuracy:.2%}  trainable parameters {params:,}")


if __name__ == "__main__":
    main()
