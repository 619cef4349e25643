"""`gb.calibrate`: a data-dependent start, so that untrained g-nets do not generate dead layers."""

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

from ._apply import apply
from ._check_gparams import check_gparams
from ._check_model import check_matches
from ._condition import condition_of
from ._plan import Free, Generated, Plan
from ._tree import GParams

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# A layer is watched through a module whose forward runs and the part of its output that is
# the layer's: `nn.MultiheadAttention` applies its `out_proj` without calling its forward.
Watch = tuple[nn.Module, Callable[[object], Tensor]]


def calibrate(
    gparams: GParams,
    plan: Plan,
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    *,
    condition: Tensor | None = None,
    task: int | Tensor | None = None,
) -> GParams:
    """Shift biases so that every layer's outputs start at zero mean on `inputs`.

    A generated layer's weights are a smooth function of its neurons' labels, so at init its
    outputs can share one offset: behind a ReLU, a negative one silences most units, and the
    next layer all of them. Training cannot recover from that at any learning rate (measured:
    `benchmarks/results/design_measurements.md`).

    Layer by layer, in the order the forward pass reaches them, each `nn.Linear` and
    `nn.ConvNd` whose bias the plan covers gets the mean of its outputs over `inputs` (the
    batch and every position) subtracted through that bias: per output unit where the bias
    is free, as one shift of the whole vector where it is generated (the output bias of the
    g-nets that generate it, which generate nothing else). Frozen biases are left alone, and
    so are the model's buffers (the forward passes run on copies: BatchNorm statistics stay)
    and the random state (dropout is off while it measures). An `nn.MultiheadAttention`'s
    `out_proj` counts as a layer; one whose forward the model never calls (a weight used
    through `F.linear`) is left as it is, with a warning.

    Args:
        gparams: From `gb.init(plan, ...)`.
        plan: The plan of `model`.
        model: The p-net, as passed to `torch.func.functional_call`.
        inputs: A batch of data, or the tuple of positional arguments of `model`.
        condition: For a conditioned plan, the condition to generate the weights for, as in
            `gb.apply` (at `gb.init` the condition's weights are zero: any gives the same).
        task: Instead of `condition`, a task's index.

    Returns:
        New gparams (the input is not changed), with the same `requires_grad` flags.

    Examples:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        >>> plan = gb.plan(model, tile="full", biases=True)
        >>> gparams = gb.calibrate(gb.init(plan), plan, model, torch.randn(64, 8))
    """
    check_gparams(gparams, plan, "gb.calibrate")
    check_matches(plan, model, "gb.calibrate", "the plan")
    condition_of(gparams, plan, condition, task, "gb.calibrate")
    args = check_inputs(inputs, "gb.calibrate")

    def generate(g: GParams) -> dict[str, Tensor]:  # uncompiled: a few forwards do not pay
        return apply(g, plan, condition=condition, task=task, compile=False)

    gparams = tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad), gparams)
    entries = {p.name: p for p in plan.params}
    watched = _watched(model)
    covered = [n for n in watched if _calibrated(entries.get(f"{n}.bias" if n else "bias"))]
    with torch.no_grad(), _measuring(model, args):  # every forward below only measures
        order = _forward_order(model, watched, generate(gparams), args)
        if missed := [n for n in covered if n not in order]:
            warnings.warn(
                f"gb.calibrate: the model's forward never called {', '.join(map(repr, missed))}, "
                "so their biases were left as they were.",
                stacklevel=2,
            )
        for name in (n for n in order if n in covered):  # each after the ones before it
            bias = entries[f"{name}.bias" if name else "bias"]  # "": the model is the layer
            mean = _output_mean(model, watched[name], generate(gparams), args)
            if not bool(mean.isfinite().all()):
                raise ValueError(
                    f"gb.calibrate: layer {name!r} has non-finite outputs on inputs (their mean "
                    f"is {mean.tolist()}), so its bias cannot be calibrated; nothing was "
                    "changed. Check the model's other weights and pass smaller inputs."
                )
            if isinstance(bias, Generated):
                _shift_generated(gparams, plan, bias, -float(mean.mean()))
            else:
                gparams["free"][bias.name].sub_(mean.to(gparams["free"][bias.name].dtype))
    return gparams


def check_inputs(inputs: Tensor | Sequence[Tensor], call: str) -> tuple[Tensor, ...]:
    """`inputs` as a tuple of positional arguments, refusing empty or non-finite tensors:
    a layer's mean over no values, or over a NaN, would make every bias it shifts NaN."""
    if not isinstance(inputs, Tensor | Sequence) or isinstance(inputs, str | bytes):
        raise TypeError(
            f"{call}: inputs must be a tensor or a sequence of the model's positional "
            f"arguments, got {type(inputs).__name__}."
        )
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if not args:
        raise ValueError(f"{call}: inputs is empty; pass a batch of data (at least one example).")
    for i, arg in enumerate(args):
        name = "inputs" if isinstance(inputs, Tensor) else f"inputs[{i}]"
        if not isinstance(arg, Tensor):
            continue
        if arg.numel() == 0:
            raise ValueError(
                f"{call}: {name} is empty (shape {tuple(arg.shape)}); pass a batch of data "
                "with at least one example."
            )
        if arg.is_floating_point() or arg.is_complex():
            bad = int((~arg.isfinite()).sum())
            if bad:
                raise ValueError(
                    f"{call}: {name} holds {bad} NaN or infinite value(s) of {arg.numel()}; "
                    "calibrating on them would make every bias NaN. Pass finite data."
                )
    return args


def _watched(model: nn.Module) -> dict[str, Watch]:
    """`{layer name: (module to hook, its output's part that is the layer's)}` of every
    linear and convolution layer, an `nn.MultiheadAttention`'s `out_proj` included."""
    watched: dict[str, Watch] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            watched[f"{name}.out_proj" if name else "out_proj"] = (module, lambda out: out[0])
        elif isinstance(module, _LAYERS) and name not in watched:
            watched[name] = (module, lambda out: out)
    return watched


def _calibrated(bias: Generated | Free | None) -> bool:
    """Whether `gb.calibrate` shifts this plan entry: a generated or trainable free bias."""
    return bias is not None and (isinstance(bias, Generated) or bias.trainable)


@contextlib.contextmanager
def _measuring(model: nn.Module, args: tuple[Tensor, ...]) -> Iterator[None]:
    """The global random state kept and dropout off, for forwards that only measure."""
    dropouts = [
        m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training
    ]
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, Tensor) and a.is_cuda})
    with torch.random.fork_rng(devices=devices):
        for m in dropouts:
            m.eval()
        try:
            yield
        finally:
            for m in dropouts:
                m.train()


def _forward_order(
    model: nn.Module, watched: dict[str, Watch], params: dict[str, Tensor], args: tuple
) -> list[str]:
    """Names of the watched layers, in the order `model`'s forward reaches them."""
    order: list[str] = []
    hooks = [
        module.register_forward_hook(lambda *_, name=name: order.append(name))
        for name, (module, _) in watched.items()
    ]
    try:
        functional_call(model, _with_buffers(model, params), args)
    finally:
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(order))


def _with_buffers(model: nn.Module, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` and copies of the model's buffers, for a forward to update."""
    return {**params, **{name: b.clone() for name, b in model.named_buffers()}}


def _output_mean(
    model: nn.Module, watch: Watch, params: dict[str, Tensor], args: tuple[Tensor, ...]
) -> Tensor:
    """Mean of a watched layer's output per output unit, over the batch and every position
    (an unbatched input, which `nn.Linear` and `nn.ConvNd` take, has no batch dimension)."""
    module, part = watch
    outputs: list[Tensor] = []
    hook = module.register_forward_hook(lambda _m, _i, out: outputs.append(part(out)))
    try:
        functional_call(model, _with_buffers(model, params), args)
    finally:
        hook.remove()
    out = outputs[0]
    spatial = len(module.kernel_size) if isinstance(module, nn.modules.conv._ConvNd) else 0
    unit = out.dim() - 1 - spatial
    others = [d for d in range(out.dim()) if d != unit]
    return out.mean(others) if others else out  # `mean([])` would average every dimension


def _shift_generated(gparams: GParams, plan: Plan, param: Generated, shift: float) -> None:
    """Add `shift` to every value of a generated parameter, through its g-nets' output bias."""
    stack = plan.stacks[param.stack_index]
    owner = torch.tensor(stack.gnet_of_tile)
    tiles = torch.cat(
        [torch.arange(b.first_tile, b.first_tile + b.num_tiles) for b in param.blocks]
    )
    b_out = gparams["stacks"][stack.key]["b_out"]
    b_out[owner[tiles].unique()] += shift / param.scale
