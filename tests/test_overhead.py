"""`gb.apply`'s work around the generation stays small: per stack and call, the aten ops other
than views (on a GPU, each one kernel launch or more) that the Triton path's wrappers and the
torch path dispatch. Counted, not timed; `benchmarks/bench_overhead.py` times them."""

import contextlib

import pytest

from benchmarks.bench_overhead import VIEWS, OpCounter, call, no_kernel_launches, ten_stacks


def launching_ops(backend: str, backward: bool) -> tuple[OpCounter, int]:
    plan, gparams = ten_stacks()
    launches = no_kernel_launches() if backend == "triton" else contextlib.nullcontext()
    with launches:
        for _ in range(2):
            call(plan, gparams, backend, backward)  # the caches filled
        with OpCounter() as counter:
            call(plan, gparams, backend, backward)
    return counter, len(plan.stacks)


def test_the_triton_forward_dispatches_only_the_terms_and_the_output_buffer():
    """Per stack: the first layer's two matmuls (`a`, `b`) and the kernel with its output
    buffer, both inside the op `gbfunc::generate` (a dispatch mode sees only the op); the code
    and placement tables come from caches, and no check reads a value."""
    counter, stacks = launching_ops("triton", backward=False)
    launching = {op: n for op, n in counter.ops.items() if op not in VIEWS}
    assert launching == {"bmm": 2 * stacks, "generate": stacks}


@pytest.mark.parametrize(
    ("backend", "backward", "most_per_stack"),
    [("triton", True, 13), ("torch", False, 10), ("torch", True, 32)],
)
def test_launching_ops_per_stack_do_not_grow(backend, backward, most_per_stack):
    """Bounds at what was measured when this test was written (bench_overhead.md). On the
    Triton path no slice's backward (a zero gradient of the whole leaf, then a copy) is
    among them: `w_in` and the kernel's output are split once, and a split's backward is one
    concatenation (the torch path's slices cut tiles to their weights)."""
    counter, stacks = launching_ops(backend, backward)
    launching = sum(n for op, n in counter.ops.items() if op not in VIEWS)
    assert launching <= most_per_stack * stacks, counter.ops
    if backend == "triton":
        assert counter.ops["slice_backward"] == 0


def test_every_function_with_a_setup_context_binds_through_a_signature_built_once():
    """`Function.apply` binds each call to `forward`'s signature where `setup_context` is
    defined; every such Function of gbfunc and the kernels carries it prebuilt
    (`gbfunc._function.signature_once`), so `inspect.signature` returns the same object."""
    import importlib
    import inspect
    import pkgutil

    import torch

    import gbfunc
    import gbfunc.kernels

    found = []
    packages = ((gbfunc.__path__, "gbfunc."), (gbfunc.kernels.__path__, "gbfunc.kernels."))
    for info in (m for path, prefix in packages for m in pkgutil.walk_packages(path, prefix)):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, torch.autograd.Function)
                and value.__module__ == info.name
                and "setup_context" in vars(value)
            ):
                found.append(value)
                assert inspect.signature(value.forward) is value.forward.__signature__, value
    assert {f.__name__ for f in found} >= {"_TileMLP", "_Generate", "_GenerateGrad", "_Rows"}
