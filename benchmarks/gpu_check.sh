#!/usr/bin/env bash
# The checks that need a GPU, as one script for the day a session is lent one (a CUDA machine
# that already has torch, triton, pytest, pytest-xdist and hypothesis; no network needed):
#   1. the kernel tests with the Triton kernels compiled for the GPU (the `gpu`-marked ones
#      included), with torch.compile(fullgraph=True) through the kernels and a whole training
#      step compiled by default and with mode="reduce-overhead" (tests/kernels);
#   2. bench_generation's GPU half;
#   3. gpu_step: a training step, plain against gbfunc at ~10x and ~100x, eager and compiled,
#      on the MLP and on GPT-2 small's shapes;
#   4. bench_overhead: gb.apply's time per call on a 10-stack plan of tiny weights, kernels
#      launched and not (the work around them, against 50 µs).
# Each part has a time limit, so that the whole fits in 10 minutes of device time; a part
# that fails does not stop the others.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]            # default: benchmarks/results
#   bash benchmarks/gpu_check.sh --dry-run RESULTS_DIR    # CPU, tiny shapes: every part runs
#
# Writes gpu_tests.log, bench_generation_gpu.md, gpu_step.md and bench_overhead_gpu.md into
# RESULTS_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
results=${1:-benchmarks/results}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
if [ $dry = 0 ]; then
    # gbfunc.kernels is the folder kernels/ (pyproject's package-dir): an editable install maps it.
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
{
    echo "# bash benchmarks/gpu_check.sh $([ $dry = 1 ] && echo --dry-run), $(date -u '+%Y-%m-%d %H:%M UTC')"
    [ $dry = 1 ] || nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$results/gpu_tests.log"

if [ $dry = 1 ]; then  # one test of each file, through Triton's interpreter
    TRITON_INTERPRET=1 timeout 300 python3 -m pytest -q -p no:randomly \
        "tests/kernels/test_generate.py::test_the_backward_kernel_starts_its_own_sums" \
        "tests/kernels/test_compiled_step.py" \
        2>&1 | tee -a "$results/gpu_tests.log"
else
    timeout 220 python3 -m pytest -q -n 8 -p no:randomly -p no:benchmark --durations=5 \
        tests/kernels \
        tests/test_labels_biases.py::test_centred_rows_sum_to_zero_on_both_backends \
        tests/test_labels_biases.py::test_generated_biases_get_gradients_and_match_the_triton_kernels \
        2>&1 | tee -a "$results/gpu_tests.log"
fi
tests=${PIPESTATUS[0]}

if [ $dry = 1 ]; then
    timeout 120 python3 -m benchmarks.bench_generation --sizes 64 --budget 0.05 --repeats 1 \
        --out "$results/bench_generation_gpu.md"
else
    timeout 120 python3 -m benchmarks.bench_generation --skip-cpu --gpu-sizes 1024 8192 \
        --out "$results/bench_generation_gpu.md"
fi
generation=$?

timeout 200 python3 -m benchmarks.gpu_step $([ $dry = 1 ] && echo --dry-run) \
    --out "$results/gpu_step.md"
step=$?

if [ $dry = 1 ]; then
    timeout 60 python3 -m benchmarks.bench_overhead --rounds 2 --inner 2 \
        --out "$results/bench_overhead_gpu.md"
else
    timeout 60 python3 -m benchmarks.bench_overhead --device cuda \
        --out "$results/bench_overhead_gpu.md"
fi
overhead=$?

echo "tests exit $tests, bench_generation exit $generation, gpu_step exit $step, bench_overhead exit $overhead"
for code in $tests $generation $step $overhead; do
    [ "$code" = 0 ] || exit "$code"
done
