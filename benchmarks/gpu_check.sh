#!/usr/bin/env bash
# The checks that need a GPU, for a CUDA machine that already has torch, triton, pytest,
# pytest-xdist and hypothesis (no network needed): the kernel tests with the Triton kernels
# compiled for the GPU (the `gpu`-marked ones included), then bench_generation's GPU half.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]    # default: benchmarks/results
#
# Writes gpu_tests.log and bench_generation_gpu.md into RESULTS_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-benchmarks/results}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
# gbfunc.kernels is the folder kernels/ (pyproject's package-dir): an editable install maps it.
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
{
    echo "# bash benchmarks/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M UTC')"
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$results/gpu_tests.log"
timeout 200 python3 -m pytest -q -n 8 -p no:randomly -p no:benchmark --durations=5 tests/kernels \
    tests/test_labels_biases.py::test_centred_rows_sum_to_zero_on_both_backends \
    tests/test_labels_biases.py::test_generated_biases_get_gradients_and_match_the_triton_kernels \
    2>&1 | tee -a "$results/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 150 python3 -m benchmarks.bench_generation --skip-cpu --gpu-sizes 1024 8192 \
    --out "$results/bench_generation_gpu.md"
bench=$?
echo "tests exit $tests, benchmark exit $bench"
exit $(( tests != 0 ? tests : bench ))
