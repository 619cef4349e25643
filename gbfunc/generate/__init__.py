"""The generation paths: one module per path, each owning its rule and its runner.

In the order the dispatcher (`gbfunc._dispatch`) tries them: `triton`, `cpu_loops`, `graph`,
`compiled_mlp`, `torch_ops`. Each has `NAME` (as `gb.explain` prints it), `refuses(call)`
(why the path does not generate the call's stack; None where it does), `variant(call)` and
its runner, `stack_weights(plan, index, leaves, variant, traced)`: one stack's parameters,
whole, which `gb.apply` calls per stack (`graph` compiles the plan instead). What several
rules read, the call and the policy of gbfunc's own compiles, is in `_policy`; the tile MLP's
forms for traced code (which `compiled-mlp` and `graph` compile, and an outer
`torch.compile` traces), their rule and their bodies, in `_traced_forms`, beside the `torch`
path's own eager bodies (`torch_ops`). These modules stand on
the plan, the specification, the tiling, `gbfunc.cpu`, `gbfunc.kernels` and the leaves
below them (the parameter tree and its checks, the compile cache, custom-op and buffer
helpers), never on the dispatcher or `gb.apply` (`tests/test_import_graph.py`).
"""
