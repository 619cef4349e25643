#!/usr/bin/env bash
# The checks that need a GPU, as one script for the day a session is lent one (a CUDA machine
# that already has torch, triton, pytest, pytest-xdist and hypothesis; no network needed).
# Every part is bound by cold compiles (torch.compile, Triton's autotuning), and a lent machine
# has 16 cores: the two parts that time nothing start first and run beside the first timed one.
#   a. the compile tests through the Triton kernels (tests/kernels/test_compiled_step.py: a
#      whole training step with torch.compile(fullgraph=True), by default and with
#      mode="reduce-overhead"; test_backend.py: grad through the kernels compiled fullgraph),
#      in the background;
#   b. the rest of the kernel tests (the `gpu`-marked ones included), in the background: they
#      passed on the GPU of 2026-11-26 and compile the kernels for every shape hypothesis draws;
#   c. gpu_step: a training step, plain against gbfunc at ~10x generated, eager and compiled,
#      on GPT-2 small's shapes, then the MLP (a step that fails is reported, the others timed;
#      each step's first call, its compile, is timed as it goes); its timed rounds wait for a
#      and b to end, so that nothing else runs on the GPU while they are timed;
#   d. bench_generation's GPU half at 1M, then 67M weights (the roofline's size; compiling and
#      autotuning the kernels takes most of its limit);
#   e. peers: the same step against hyper-nn and hypnettorch (benchmarks/peers.py --device
#      cuda --quick), the two installed from the wheels in .whl/ (bash benchmarks/gpu_wheels.sh
#      downloads them; the device tool carries .whl) into a folder of their own on PYTHONPATH,
#      never into the environment: both ship a top-level `tests` package;
#   f. bench_overhead: gb.apply's time per call on a 10-stack plan of tiny weights, captured
#      (torch.compile with CUDA graphs, against 50 µs), then eager, kernels launched and not.
# Each part has a time limit (the T_ values below; c-f run one after another and, with the
# installs, fit in 10 minutes of device time; a and b fit inside c's), writes its results file
# as it goes or at its end, and what the benchmarks print goes to gpu_check.log as they print
# it, so that a part cut short still leaves its numbers; a part that fails does not stop the
# others.
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]            # default: benchmarks/results
#   bash benchmarks/gpu_check.sh --dry-run RESULTS_DIR    # CPU, tiny shapes: every part runs
#
# Writes into RESULTS_DIR: gpu_tests.log (versions, the summary line of a and of b),
# gpu_tests_compile.log (a), gpu_tests_kernels.log (b), gpu_step.md, bench_generation_gpu.md,
# peers_gpu.md and peers_gpu.json, bench_overhead_gpu.md, and gpu_check.log. The peers' wheels
# are read from .whl/, or from the folder GBFUNC_PEER_WHEELS names; with none there, peers.py
# runs without them and says "not installed" in their rows (the dry run in the test suite
# installs a stand-in wheel).
# A lent machine returns at most 8 files, so pack them (as on 2026-11-28, 600 s limit):
#   timeout -k 5 580 bash benchmarks/gpu_check.sh $OUT/r; cd $OUT && tar czf all.tgz r && rm -rf r
set -uo pipefail
cd "$(dirname "$0")/.."

# Time limits in seconds. c-f run one after another: 545 s (c: 330, d: 80, e: 15 + 45,
# f: 75), which leaves 55 s of the 10 minutes for gbfunc's install and the start; a and b run
# beside c and end within its limit. On the H200 of 2026-11-29 (gpu_check_1129.log,
# gpu_rerun_1129.log) the compile tests took more than 120 s cold and 106 s warm, GPT-2's plain
# step compiled in 161 s, and no other part got past its compiles within 45-90 s.
T_COMPILE=200     # a. the compile tests (beside c)
T_KERNELS=200     # b. the rest of the kernel tests (beside c)
T_STEP=330        # c. gpu_step
T_GENERATION=80   # d. bench_generation
T_WHEELS=15       # e. installing the peers' wheels
T_PEERS=45        # e. peers.py
T_OVERHEAD=75     # f. bench_overhead (its captured calls compile first)

dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
    # CPU: slower, and the dry run is not timed; the limits only catch a hang.
    T_COMPILE=300 T_KERNELS=120 T_STEP=400 T_GENERATION=120 T_WHEELS=60 T_PEERS=300
    T_OVERHEAD=180
fi
results=${1:-benchmarks/results}
mkdir -p "$results"
log="$results/gpu_check.log"  # started by the header below
export PYTHONUNBUFFERED=1
if [ $dry = 0 ]; then
    # gbfunc.kernels is the folder kernels/ (pyproject's package-dir): an editable install maps it.
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
part() {  # a part's heading on a line of its own (the last output may lack its newline)
    printf '\n== %s, %s\n' "$*" "$(date -u '+%H:%M:%S UTC')" | tee -a "$log"
}
{
    echo "# bash benchmarks/gpu_check.sh $([ $dry = 1 ] && echo --dry-run), $(date -u '+%Y-%m-%d %H:%M UTC')"
    [ $dry = 1 ] || nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$results/gpu_tests.log" "$log"

# The last line pytest printed ("1 failed, 2 passed in 50.10s") after its exit code, or that
# its limit cut it short; as a line of gpu_tests.log and gpu_check.log.
summarise() {  # NAME LOG EXIT LIMIT
    local outcome
    outcome=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$2" | tail -1)
    case $3 in
        124 | 137) outcome="cut short at its limit, $4 s${outcome:+; $outcome}" ;;
    esac
    echo "$1: exit $3: ${outcome:-no summary}" | tee -a "$results/gpu_tests.log" "$log"
}

# a and b, in the background, each into its own log.
part "a. compile tests, in the background"
COMPILE_TESTS=(tests/kernels/test_compiled_step.py tests/kernels/test_backend.py -k compiles)
if [ $dry = 1 ]; then  # on CPU the compiled step runs the torch path; the kernels interpreted
    COMPILE_ENV=(TRITON_INTERPRET=1)
else
    COMPILE_ENV=()
    COMPILE_TESTS+=(-n 3)
fi
env "${COMPILE_ENV[@]}" timeout -k 5 $T_COMPILE python3 -m pytest -q -p no:randomly \
    -p no:benchmark --durations=5 "${COMPILE_TESTS[@]}" >"$results/gpu_tests_compile.log" 2>&1 &
compile_pid=$!

part "b. the rest of the kernel tests, in the background"
if [ $dry = 1 ]; then  # one test, through Triton's interpreter
    TRITON_INTERPRET=1 timeout -k 5 $T_KERNELS python3 -m pytest -q -p no:randomly \
        "tests/kernels/test_generate.py::test_the_backward_kernel_starts_its_own_sums" \
        >"$results/gpu_tests_kernels.log" 2>&1 &
else
    timeout -k 5 $T_KERNELS python3 -m pytest -q -n 6 -p no:randomly -p no:benchmark \
        --durations=5 tests/kernels -k "not compiles" \
        tests/test_labels_biases.py::test_centred_rows_sum_to_zero_on_both_backends \
        tests/test_labels_biases.py::test_generated_biases_get_gradients_and_match_the_triton_kernels \
        >"$results/gpu_tests_kernels.log" 2>&1 &
fi
kernels_pid=$!

part "c. gpu_step"
timeout -k 5 $T_STEP python3 -m benchmarks.gpu_step $([ $dry = 1 ] && echo --dry-run || echo --targets 10) \
    --wait-for $compile_pid $kernels_pid --out "$results/gpu_step.md" 2>&1 | tee -a "$log"
step=${PIPESTATUS[0]}

wait $compile_pid
compile_tests=$?
summarise "compile tests" "$results/gpu_tests_compile.log" $compile_tests $T_COMPILE
wait $kernels_pid
tests=$?
summarise "the rest of the kernel tests" "$results/gpu_tests_kernels.log" $tests $T_KERNELS

part "d. bench_generation"
if [ $dry = 1 ]; then
    timeout -k 5 $T_GENERATION python3 -m benchmarks.bench_generation --sizes 64 --budget 0.05 \
        --repeats 1 --out "$results/bench_generation_gpu.md" 2>&1 | tee -a "$log"
else
    timeout -k 5 $T_GENERATION python3 -m benchmarks.bench_generation --skip-cpu \
        --gpu-sizes 1024 8192 --out "$results/bench_generation_gpu.md" 2>&1 | tee -a "$log"
fi
generation=${PIPESTATUS[0]}

part "e. peers"
wheels=${GBFUNC_PEER_WHEELS:-.whl}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G "$wheels/*.whl" >/dev/null; then
    {
        echo "installing into $site, on PYTHONPATH for peers.py alone:" "$wheels"/*.whl
        timeout -k 5 $T_WHEELS python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target "$site" "$wheels"/*.whl
        echo "installed: $(cd "$site" && ls -d -- *.dist-info 2>/dev/null | tr '\n' ' ')"
    } 2>&1 | tee -a "$log"
else
    echo "no wheels in $wheels (bash benchmarks/gpu_wheels.sh downloads them): the peers run" \
        "without hyper-nn and hypnettorch unless this python has them" | tee -a "$log"
fi
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 $T_PEERS python3 -m benchmarks.peers \
    $([ $dry = 1 ] && echo --dry-run || echo --device cuda --quick) --out "$results" --name peers_gpu \
    2>&1 | tee -a "$log"
peers=${PIPESTATUS[0]}

part "f. bench_overhead"
if [ $dry = 1 ]; then
    timeout -k 5 $T_OVERHEAD python3 -m benchmarks.bench_overhead --rounds 2 --inner 2 \
        --out "$results/bench_overhead_gpu.md" 2>&1 | tee -a "$log"
else
    timeout -k 5 $T_OVERHEAD python3 -m benchmarks.bench_overhead --device cuda \
        --out "$results/bench_overhead_gpu.md" 2>&1 | tee -a "$log"
fi
overhead=${PIPESTATUS[0]}

echo "compile tests exit $compile_tests, kernel tests exit $tests, gpu_step exit $step," \
    "bench_generation exit $generation, peers exit $peers, bench_overhead exit $overhead" \
    | tee -a "$log"
for code in $compile_tests $tests $step $generation $peers $overhead; do
    [ "$code" = 0 ] || exit "$code"
done
