"""Tensor parallelism for transformers' GPT-2, whose layers are `Conv1D`s (weights `(in, out)`).

Attention is sharded by heads: the fused `c_attn` (Q, K and V side by side along its output
columns) gives each rank its slice of Q, of K and of V, held as one DTensor sharded on
columns whose global order is the parts interleaved per rank (`[Q0 K0 V0 | Q1 K1 V1]`), so
the attention's own `split` and head reshape work on the local tensor; `c_proj` is
row-parallel. The MLP is column- then row-parallel. `gbd.TensorParallel(...,
fused=FUSED)` generates exactly those slices.

    parallelize_module(model, mesh["tp"], tp_plan(model))
    shard_heads(model, tp)
    shards = gbd.TensorParallel(plan, model, mesh["tp"], fused=FUSED)
"""

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

FUSED = {"*.attn.c_attn.weight": 3, "*.attn.c_attn.bias": 3}  # Q, K, V


class _Conv1DParallel(ParallelStyle):
    """A `Conv1D` with its weight and bias sharded as given, its input made a DTensor of
    `input_placement` and its output handed on as this rank's local tensor."""

    def __init__(
        self,
        weight: Placement,
        bias: Placement,
        input_placement: Placement,
        reduce_output: bool,
    ) -> None:
        super().__init__()
        self.placements = {"weight": weight, "bias": bias}
        self.input_placement = input_placement
        self.reduce_output = reduce_output

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            placement = self.placements[param_name]
            sharded = nn.Parameter(distribute_tensor(param, mesh, [placement]))
            module.register_parameter(param_name, sharded)

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_placement], run_check=False)
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
        if self.reduce_output:  # partial sums over the input shards
            output = output.redistribute(mesh, [Replicate()])
        return output.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            lambda mod, inputs, mesh: self._input(mod, inputs, mesh),
            lambda mod, output, mesh: self._output(mod, output, mesh),
        )


def colwise() -> ParallelStyle:
    """Output columns sharded: the local output is this rank's columns."""
    return _Conv1DParallel(Shard(1), Shard(0), Replicate(), reduce_output=False)


def rowwise() -> ParallelStyle:
    """Input rows sharded: the local input is this rank's columns of the previous output."""
    return _Conv1DParallel(Shard(0), Replicate(), Shard(-1), reduce_output=True)


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """`parallelize_module` plan of a `GPT2LMHeadModel`: heads and MLP columns per rank."""
    plan = {}
    for i in range(len(model.transformer.h)):
        block = f"transformer.h.{i}"
        plan[f"{block}.attn.c_attn"] = colwise()
        plan[f"{block}.attn.c_proj"] = rowwise()
        plan[f"{block}.mlp.c_fc"] = colwise()
        plan[f"{block}.mlp.c_proj"] = rowwise()
    return plan


def shard_heads(model: nn.Module, tp: int) -> None:
    """Make each attention split its local Q/K/V (a `1/tp` of each) into its local heads."""
    for block in model.transformer.h:
        block.attn.split_size = block.attn.embed_dim // tp
        block.attn.num_heads = block.attn.num_heads // tp
