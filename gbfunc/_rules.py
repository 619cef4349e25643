"""Which parameters of which module types are generated, and how each is laid out.

A rule maps a module to its generatable parameters. Each is described by a `Layout`: the
parameter is viewed as a matrix `(M, N)` of kernel windows (`shape[2:]`), optionally split
into equal blocks (e.g. the Q, K and V projections of `in_proj_weight`), each block tiled on
its own. Rules also give the std that the module's own initialisation draws the parameter
with, so generated weights start at the same scale (checked against real inits in tests).
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn
from torch.nn.utils import parametrize

from ._numbers import as_integer, integer, real


@dataclass(frozen=True)
class Layout:
    """How one generatable parameter maps onto tiles.

    Attributes:
        init_std: Std of the parameter under the module's own initialisation.
        splits: Number of equal blocks the parameter is cut into along `split_dim`, each tiled
            separately so no tile straddles two logical matrices.
        split_dim: 0 (rows) or 1 (columns).
        embedding: True for embedding tables (generated only when asked).
        bias: True for a layer's bias vector (generated only with `biases=True`, as a one-column
            matrix whose rows are the layer's output neurons).
        inputs_first: True for a weight stored `(inputs, outputs)`, as transformers' `Conv1D`
            stores it: `center=True` and neuron labels, which take rows for output neurons,
            refuse it.
    """

    init_std: float
    splits: int = 1
    split_dim: int = 0
    embedding: bool = False
    bias: bool = False
    inputs_first: bool = False

    def __post_init__(self) -> None:
        """Refuse fields the planner cannot use, here rather than deep inside `gb.plan`."""
        std = float(real("gb.Layout", "init_std", self.init_std, above=0))
        splits = integer("gb.Layout", "splits", self.splits, minimum=1)
        split_dim = as_integer(self.split_dim)
        if split_dim not in (0, 1):
            raise ValueError(f"gb.Layout: split_dim must be 0 or 1, got {self.split_dim!r}.")
        for flag in ("embedding", "bias", "inputs_first"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"gb.Layout: {flag} must be a bool, got {getattr(self, flag)!r}.")
        object.__setattr__(self, "init_std", std)  # e.g. a numpy float, as Python's
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "split_dim", split_dim)  # a numpy int too, as JSON takes it


Rule = Callable[[nn.Module], dict[str, Layout]]
_RULES: dict[type, Rule] = {}


def register_rule(module_type: type, rule: Rule) -> None:
    """Declare which parameters of `module_type` (and its subclasses) are generated.

    Args:
        module_type: An `nn.Module` subclass. The most specific registered base wins.
        rule: `rule(module) -> {local_param_name: Layout}`; parameters it leaves out stay free.

    Examples:
        >>> class Bilinear2(nn.Bilinear): ...
        >>> gb.register_rule(Bilinear2, lambda m: {"weight": gb.Layout(init_std=0.1)})
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(
            f"gb.register_rule: module_type must be an nn.Module subclass, got {module_type!r}."
        )
    if not callable(rule):
        raise TypeError(f"gb.register_rule: rule must be callable, got {rule!r}.")
    _RULES[module_type] = rule


def rule_for(module: nn.Module) -> Rule | None:
    """The rule registered for the nearest class in `type(module).__mro__`, if any."""
    found = _registered(module)
    return None if found is None else found[1]


def _registered(module: nn.Module) -> tuple[type, Rule] | None:
    """The nearest class in `type(module).__mro__` with a rule, and that rule."""
    for cls in type(module).__mro__:
        if cls in _RULES:
            return cls, _RULES[cls]
        named = _NAMED_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if named is not None:
            return cls, named
    return None


def layouts_of(module: nn.Module) -> dict[str, Layout]:
    """What `module`'s rule returns (`{}` without one), checked against the rule contract:
    a dict from names of the module's own parameters to `gb.Layout`s that fit them."""
    found = _registered(module)
    if found is None:
        return {}
    cls, rule = found
    name = getattr(rule, "__qualname__", None) or type(rule).__qualname__
    where = f"gb.plan: the rule {getattr(rule, '__module__', '?')}.{name} registered for "
    where += cls.__qualname__
    if cls is not type(module):
        where += f" (called on its subclass {type(module).__qualname__})"
    try:
        layouts = rule(module)
    except Exception as e:
        e.add_note(f"{where} raised this on a {type(module).__qualname__}.")
        raise
    params = dict(module.named_parameters(recurse=False))
    contract = (
        "a rule must return a dict {local parameter name: gb.Layout(...)} naming some of the "
        f"module's own parameters ({', '.join(params) or 'it has none'}); see gb.register_rule."
    )
    if not isinstance(layouts, Mapping):
        raise TypeError(f"{where} returned {layouts!r}; {contract}")
    # A weight computed from other parameters (weight_norm, a parametrization) is no
    # parameter to generate: those stay free, as the layer's own code needs them.
    layouts = {k: v for k, v in layouts.items() if not _derived(module, k, params)}
    for local, layout in layouts.items():
        if not isinstance(local, str) or local not in params:
            raise ValueError(f"{where} returned the key {local!r}; {contract}")
        if not isinstance(layout, Layout):
            raise TypeError(f"{where} returned {layout!r} for {local!r}; {contract}")
        shape = tuple(params[local].shape)
        if layout.bias and len(shape) != 1:
            raise ValueError(
                f"{where} returned bias=True for {local!r} of shape {shape}; a bias is a vector "
                "(one value per output neuron)."
            )
        if layout.splits > 1 and len(shape) < 2:
            raise ValueError(
                f"{where} returned splits={layout.splits} for {local!r} of shape {shape}; only "
                "a matrix (2 dims or more) is split."
            )
        if layout.splits > 1 and shape[layout.split_dim] % layout.splits:
            raise ValueError(
                f"{where} returned splits={layout.splits} along dim {layout.split_dim} for "
                f"{local!r} of shape {shape}; the splits must divide that dimension."
            )
    return dict(layouts)


def _derived(module: nn.Module, local: object, params: Mapping[str, object]) -> bool:
    """Whether `local` names a tensor `module` computes from its parameters rather than holds
    (`torch.nn.utils.parametrizations.weight_norm` and the like, the legacy `weight_norm` and
    `spectral_norm` hooks, which keep `weight_g`/`weight_v` and `weight_orig`)."""
    if not isinstance(local, str) or local in params:
        return False
    legacy = (f"{local}_g" in params and f"{local}_v" in params) or f"{local}_orig" in params
    return legacy or parametrize.is_parametrized(module, local)


def kaiming_uniform_std(fan_in: int) -> float:
    """Std of `kaiming_uniform_(a=sqrt(5))`, PyTorch's default for Linear and Conv weights."""
    return 1.0 / math.sqrt(3.0 * fan_in)


def xavier_std(fan_in: int, fan_out: int) -> float:
    """Std of `xavier_uniform_` (and `xavier_normal_`)."""
    return math.sqrt(2.0 / max(1, fan_in + fan_out))


def step_scale(init_std: float, shape: tuple[int, ...], inputs_first: bool = False) -> float:
    """The unit in which a generated weight of `shape` starting at std `init_std` learns
    (`Generated.scale`): `init_std`, at most `1 / sqrt(fan_in)` (a bias: no cap). The fan-in
    is `shape[0]` (times a kernel window's size) for a weight stored `(inputs, outputs, ...)`
    (`Layout.inputs_first`).

    Adam moves a g-net's or a table's value by about its rate per step, so a generated weight
    by about `rate * scale`. Linear, conv and attention weights start below the cap, where
    the default rates were measured; `nn.Embedding`'s N(0, 1) rows start `sqrt(dim)` times
    above it, and at their own std as the unit the character transformer's generated
    position table lost its scale in the first steps on some seeds and training sat on a
    plateau until it regrew (benchmarks/results/stability.md).
    """
    if len(shape) < 2:
        return init_std
    return min(init_std, 1.0 / math.sqrt(weight_fan_in(shape, inputs_first)))


def weight_fan_in(shape: tuple[int, ...], inputs_first: bool = False) -> int:
    """Inputs per output of a weight of `shape` (at least 1): torch's reading (`shape[1]`
    times a kernel window's size), or `shape[0]` times it for a weight stored
    `(inputs, outputs, ...)` (`Layout.inputs_first`). A vector (a bias) has 1."""
    if len(shape) < 2:
        return 1
    return max(1, shape[0] * math.prod(shape[2:])) if inputs_first else _fan_in(shape)


def _fan_in(shape: tuple[int, ...]) -> int:
    """Inputs per output (at least 1, so empty layers get a finite scale)."""
    return max(1, shape[1] * math.prod(shape[2:]))


def _linear_like(module: nn.Module) -> dict[str, Layout]:
    if not _holds_weight(module):
        return {}
    std = kaiming_uniform_std(_fan_in(tuple(module.weight.shape)))
    layouts = {"weight": Layout(std)}
    if module.bias is not None:  # U(-1/sqrt(fan_in), 1/sqrt(fan_in)): the weight's std
        layouts["bias"] = Layout(std, bias=True)
    return layouts


def _attention(module: nn.MultiheadAttention) -> dict[str, Layout]:
    if module.in_proj_weight is not None:
        rows, cols = module.in_proj_weight.shape
        # Q, K and V are three matrices stacked on rows: tile each on its own.
        return {"in_proj_weight": Layout(xavier_std(cols, rows), splits=3, split_dim=0)}
    return {
        name: Layout(xavier_std(p.shape[1], p.shape[0]))
        for name, p in (
            ("q_proj_weight", module.q_proj_weight),
            ("k_proj_weight", module.k_proj_weight),
            ("v_proj_weight", module.v_proj_weight),
        )
    }


def _embedding(module: nn.Embedding) -> dict[str, Layout]:
    return {"weight": Layout(1.0, embedding=True)} if _holds_weight(module) else {}


def _holds_weight(module: nn.Module) -> bool:
    """Whether `module.weight` is a parameter of its own (not a buffer, None, or removed),
    which the built-in rules generate."""
    return isinstance(module._parameters.get("weight"), nn.Parameter)


def _hf_conv1d(module: nn.Module) -> dict[str, Layout]:
    if not _holds_weight(module):
        return {}
    # transformers' Conv1D stores (in, out) and draws N(0, 0.02); GPT-2's c_attn fuses Q, K, V
    # on columns (nf = 3 * n_embd), split so tiles never straddle them.
    splits = 3 if getattr(module, "nf", 0) == 3 * module.weight.shape[0] else 1
    return {"weight": Layout(0.02, splits=splits, split_dim=1, inputs_first=True)}


for _cls in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_cls, _linear_like)
register_rule(nn.MultiheadAttention, _attention)
register_rule(nn.Embedding, _embedding)
# Matched by qualified name so that gbfunc never imports transformers itself.
_NAMED_RULES: dict[str, Rule] = {"transformers.pytorch_utils.Conv1D": _hf_conv1d}


def free_init(module: nn.Module, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """How `gb.init` draws a free parameter: `(kind, value)` with kind in zeros/ones/uniform/normal
    (value: the bound or std), or normal_padded (N(0, 1) with row `value` zero).

    Mirrors the module's own `reset_parameters` for the common layers, also for weights left
    free by the caller; other parameters get ones (1-D weights, i.e. scales), zeros (biases,
    other 1-D) or N(0, 0.02) (matrices).
    """
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        if module.padding_idx is not None:  # N(0, 1), then its padding row zeroed
            return ("normal_padded", module.padding_idx)
        return ("normal", 1.0)
    if _is_named(module, "transformers.pytorch_utils.Conv1D"):
        return ("normal", 0.02) if name == "weight" else ("zeros", 0.0)
    if isinstance(module, nn.MultiheadAttention):
        if len(shape) == 2:  # xavier_uniform_ over the whole (fused) matrix
            return ("uniform", math.sqrt(6.0 / max(1, shape[0] + shape[1])))
        if name in ("bias_k", "bias_v"):  # xavier_normal_ of (1, 1, E): fans of E each
            return ("normal", 1.0 / math.sqrt(shape[-1]))
        return ("zeros", 0.0)
    if isinstance(module, nn.Bilinear):  # weight and bias: U(+-1 / sqrt(in1_features))
        return ("uniform", 1.0 / math.sqrt(max(1, module.in1_features)))
    # A transposed convolution's (in, out / groups, k...) weight: torch's fan-in is the
    # second dimension times the kernel's, as `_fan_in` reads it.
    linear_like = nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.modules.conv._ConvTransposeNd
    if isinstance(module, linear_like) and isinstance(module.weight, Tensor):
        if name == "bias" and isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
            return ("zeros", 0.0)  # MultiheadAttention zeroes out_proj.bias
        # kaiming_uniform_(a=sqrt(5)) for the weight and the bias's own rule share this bound.
        return ("uniform", 1.0 / math.sqrt(_fan_in(tuple(module.weight.shape))))
    if len(shape) <= 1:
        return ("ones", 1.0) if name == "weight" else ("zeros", 0.0)
    return ("normal", 0.02)


def _is_named(module: nn.Module, qualname: str) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == qualname for c in type(module).__mro__)
