"""How compiled one-output g-nets reduce over their hidden units, side by side in one run.

The compiled backward of one-layer, one-output g-nets
(`gbfunc.generate._traced_forms._fused_reductions`)
reduces over the hidden units that `vectorised_units` counts as one vectorised axis, and
over the others one unit at a time; so does the forward of tiles narrower than a vector
register (`_one_output_by_units`; wider tiles sum with the columns as the vector axis).
This times the backward four ways, interleaved: three written for inductor (every unit
vectorised, where inductor pads a short axis into one masked vector; whole registers
vectorised and the rest one at a time; gbfunc's rule, the rest as a masked vector where it
fills more than half a register) and the one pass in C (`gbfunc.cpu._relu_loops`), which gbfunc
takes for ReLU in float32 where `_relu_loops.sums_usable` says so (marked `*`).

    python -m benchmarks.bench_unit_split

Writes what it prints to `benchmarks/results/bench_unit_split.md` under the command, machine
and date.
"""

import statistics
import time
from unittest import mock

import torch

from benchmarks._meta import compile_static, cpu_benchmark_args, recorded
from gbfunc.cpu import _relu_loops
from gbfunc.generate import _traced_forms

SHAPES = [(1, 512, 784, 4), (1, 512, 784, 16), (135, 57, 96, 32)] + [
    (44, 128, 128, h) for h in (4, 6, 8, 10, 12, 14, 20, 32)
]


def every_unit(row_terms: torch.Tensor) -> int:
    return row_terms.shape[-1]


def whole_registers(row_terms: torch.Tensor) -> int:
    hidden = row_terms.shape[-1]
    return hidden - hidden % _traced_forms._vector_lanes(row_terms.dtype, row_terms.device.type)


RULES = {
    "all vectorised": every_unit,
    "whole registers": whole_registers,
    "gbfunc's rule": _traced_forms.vectorised_units,
}
ONE_PASS = "one pass in C"


@torch.compiler.assume_constant_result
def _never(units: int, dtype: torch.dtype, device_type: str) -> bool:
    return False


@torch.compiler.assume_constant_result
def _always(units: int, dtype: torch.dtype, device_type: str) -> bool:
    return _relu_loops.compiled_loop(_relu_loops._SUMS, units) is not None


def backward_ms(shape: tuple[int, int, int, int], rounds: int, inner: int) -> dict[str, float]:
    """Median ms of the compiled backward under each rule, rounds interleaved."""
    tiles, rows, cols, hidden = shape
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(tiles, rows, cols, generator=gen)
    a, b = (torch.randn(tiles, n, hidden, generator=gen) for n in (rows, cols))
    c, w = (torch.randn(tiles, hidden, generator=gen) for _ in range(2))
    # One compiled copy per variant; dynamo guards on the patched functions, so each runs
    # under its own.
    variants = [*RULES, ONE_PASS]
    compiled = {name: compile_static(_traced_forms._fused_reductions) for name in variants}

    def run(name: str, calls: int) -> None:
        rule = RULES.get(name, _traced_forms.vectorised_units)
        one_pass = _always if name == ONE_PASS else _never
        with (
            mock.patch.object(_traced_forms, "vectorised_units", rule),
            mock.patch.object(_relu_loops, "sums_usable", one_pass),
        ):
            for _ in range(calls):
                compiled[name](g, a, b, c, w, "relu")

    for name in variants:
        run(name, 3)  # compile and warm up
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            start = time.perf_counter()
            run(name, inner)
            samples[name].append((time.perf_counter() - start) / inner * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    args = cpu_benchmark_args(__doc__, "bench_unit_split.md")
    lanes = _traced_forms._vector_lanes(torch.float32, "cpu")
    with recorded(args.out, "Compiled one-output g-nets: reducing over the hidden units"):
        print(f"float32 lanes: {lanes}; ReLU backward, ms, medians of 7 rounds of 20 calls")
        print(f"{'tiles, TH, Q, H':<22}" + "".join(f"{n:>18}" for n in [*RULES, ONE_PASS]))
        for shape in SHAPES:
            times = backward_ms(shape, rounds=7, inner=20)
            taken = "*" if _relu_loops.sums_usable(shape[-1], torch.float32, "cpu") else " "
            row = "".join(f"{times[name]:>18.2f}" for name in RULES)
            print(f"{shape!s:<22}{row}{times[ONE_PASS]:>17.2f}{taken}")


if __name__ == "__main__":
    main()
