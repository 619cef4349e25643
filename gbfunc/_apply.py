"""`gb.apply`: g-net parameters in, every p-net parameter out, as a pure function."""

from torch import Tensor

from ._backend import fused_weights, use_triton
from ._check_gparams import check_gparams
from ._evaluate import hashed_tiles, stack_terms
from ._graph import evaluates_through_loops, generate, runs_as_graph
from ._plan import Plan
from ._select import Selection, assemble, center_rows, parameters
from ._tilemlp import plain_eager
from ._tree import GParams


def apply(
    gparams: GParams,
    plan: Plan,
    *,
    check: bool = False,
    backend: str = "auto",
    compile: bool | None = None,
) -> dict[str, Tensor]:
    """Generate every parameter of the p-net described by `plan`.

    Each stack's g-nets are evaluated on their tiles in one batched call; tiles are laid out
    on each weight's grid, cut to its shape and scaled. Free parameters pass through. Pure:
    no module is touched, so it composes with `torch.func.grad`, `vmap` and `torch.compile`.

    Args:
        gparams: From `gb.init(plan, ...)` (or trained from it).
        plan: The plan that made `gparams`.
        check: Also reject NaN or inf in `gparams` (reads values: not for compiled code).
        backend: `"torch"`, `"triton"` (fused kernels, `gbfunc.kernels`; through Triton's
            interpreter on CPU) or `"auto"`: Triton for CUDA tensors, torch otherwise.
        compile: On the torch backend, called eagerly (not under `torch.compile` or a
            `torch.func` transform), generate through compiled code, cached: one graph per
            plan (g-nets and layout, forward and backward), or, where a stack's hidden
            activations are too large to hold whole, each stack's g-net evaluation compiled
            per signature and run in chunks; a plan of row g-nets or one-output g-nets with
            one ReLU layer, on CPU in float32, runs two C loops per stack instead, leaves to
            weights and back (`gbfunc._relu_rows`). The first call compiles (seconds). `None`: only
            where it pays (plans of `AUTO_GRAPH_WEIGHTS` generated weights, with gradients
            enabled; stacks of `AUTO_COMPILE_ELEMENTS` hidden activations); with gradients off
            (evaluation), such plans take the C loops where they suit, never a graph. `False`: never
            (for debugging, and for double backward, which the compiled graph does not
            support). With dynamo switched off (`torch._dynamo.config.disable`), nothing
            compiles. The result is the same either way, to rounding.

    Returns:
        `{name: tensor}` for every parameter, ready for
        `torch.func.functional_call(model, params, args)`.

    Example:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> params = gb.apply(gb.init(plan), plan)
        >>> torch.func.functional_call(model, params, (torch.randn(2, 64),)).shape
        torch.Size([2, 32])
    """
    check_gparams(gparams, plan, "gb.apply", values=check)
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"gb.apply: compile must be True, False or None, got {compile!r}.")
    stacks = gparams["stacks"]
    if not use_triton(backend, plan, stacks):
        eager = plain_eager()
        as_graph = eager and runs_as_graph(plan, compile)
        if as_graph or (eager and evaluates_through_loops(plan, compile)):
            selection = Selection.whole(plan)
            if selection.runs_direct(gparams):  # row g-nets in C: no graph needed
                return selection.apply(gparams, compile=True)
            graph = generate(plan, stacks) if as_graph else None
            if graph is not None:
                return parameters(plan.params, gparams, lambda p: graph[p.name])
        return Selection.whole(plan).apply(gparams, compile=compile)
    generated = fused_weights(plan, [stack_terms(s, stacks[s.key]) for s in plan.stacks])
    hashed = {  # linear in the tiles, so laid out on its own and added to the kernels'
        s.key: hashed_tiles(s, stacks[s.key]["tile_hash"]) for s in plan.stacks if s.genome.hashed
    }
    for p in plan.generated:  # the kernels scale; centring reads whole rows, done here
        stack = plan.stacks[p.stack_index]
        if p.center:
            generated[p.name] = center_rows(generated[p.name])
        if stack.key in hashed:
            generated[p.name] = generated[p.name] + assemble(p, stack, hashed[stack.key])
    return parameters(plan.params, gparams, lambda p: generated[p.name])
