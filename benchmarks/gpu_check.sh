#!/usr/bin/env bash
# The checks that need a GPU, as one script for the day a session is lent one (a CUDA machine
# that already has torch, triton, pytest, pytest-xdist and hypothesis; no network needed).
# Every part is bound by cold compiles (torch.compile, Triton's autotuning), so the parts run
# in the order of what a run cut short should already have told us, and the two that time
# nothing run in the background beside the longest compile (a lent machine has 16 cores):
#   a. gpu_step's eager steps: a training step, plain against gbfunc at ~10x generated, on
#      GPT-2 small's shapes, then the MLP; nothing to compile but the kernels' autotuning;
#   b. the compile tests through the Triton kernels (tests/kernels/test_compiled_step.py: a
#      whole training step with torch.compile(fullgraph=True), by default and with
#      mode="reduce-overhead"; test_backend.py: grad through the kernels compiled fullgraph),
#      in the background;
#   c. the rest of the kernel tests (the `gpu`-marked ones included), in the background: they
#      passed on the GPU of 2026-11-26 and compile the kernels for every shape hypothesis draws;
#   d. gpu_step's compiled steps (one torch.compile(fullgraph=True) each; a step that fails is
#      reported, the others timed; each first call, its compile, is timed as it goes); its
#      timed rounds wait for b and c to end, so that nothing else runs on the GPU then;
#   e. bench_generation's GPU half at 67M weights (the roofline's size);
#   f. peers: the same step against hyper-nn and hypnettorch (benchmarks/peers.py --device
#      cuda --quick), the two installed from the wheels in .whl/ (bash benchmarks/gpu_wheels.sh
#      downloads them; the device tool carries .whl) into a folder of their own on PYTHONPATH,
#      never into the environment: both ship a top-level `tests` package;
#   g. bench_overhead: gb.apply's time per call on a 10-stack plan of tiny weights, captured
#      (torch.compile with CUDA graphs, against 50 µs), then eager, kernels launched and not.
# Each part has a time limit (the T_ values below: the parts but b and c run one after another
# and, with the install, fit in 10 minutes of device time; b and c end within d's), writes its
# results file as it goes or at its end, and what the benchmarks print goes to gpu_check.log
# as they print it, so that a part cut short still leaves its numbers; a part that fails does
# not stop the others. `--parts LETTERS` runs only those (a later GPU session can give the
# whole 10 minutes to the parts an earlier one did not reach).
#
#   bash benchmarks/gpu_check.sh [--parts efg] [RESULTS_DIR]        # default: benchmarks/results
#   bash benchmarks/gpu_check.sh --dry-run [--parts ...] RESULTS_DIR # CPU, tiny shapes
#
# Writes into RESULTS_DIR: gpu_tests.log (versions, the summary lines of b and c),
# gpu_tests_compile.log (b), gpu_tests_kernels.log (c), gpu_step_eager.md (a), gpu_step.md (d),
# bench_generation_gpu.md, peers_gpu.md and peers_gpu.json, bench_overhead_gpu.md, and
# gpu_check.log. The peers' wheels are read from .whl/, or from the folder GBFUNC_PEER_WHEELS
# names; with none there, peers.py runs without them and says "not installed" in their rows
# (the dry run in the test suite installs a stand-in wheel).
# A lent machine returns at most 8 files, so pack them (as on 2026-11-28, 600 s limit):
#   timeout -k 5 580 bash benchmarks/gpu_check.sh $OUT/r; cd $OUT && tar czf all.tgz r && rm -rf r
set -uo pipefail
cd "$(dirname "$0")/.."

# Time limits in seconds. a and d-g run one after another: 560 s (a: 100, d: 300, e: 60,
# f: 15 + 40, g: 45), which leaves 40 s of the 10 minutes for gbfunc's install (5 s on the
# H200) and the start; b and c run beside d and end within its limit. On the H200 of
# 2026-11-29 (gpu_check_1129.log, gpu_rerun_1129.log) the compile tests took more than 120 s
# cold and 106 s warm, GPT-2's plain step compiled in 161 s, and no other part got past its
# compiles within 45-90 s.
T_STEP_EAGER=100  # a. gpu_step, eager
T_COMPILE=200     # b. the compile tests (beside d)
T_KERNELS=200     # c. the rest of the kernel tests (beside d)
T_STEP=300        # d. gpu_step, compiled
T_GENERATION=60   # e. bench_generation
T_WHEELS=15       # f. installing the peers' wheels
T_PEERS=40        # f. peers.py
T_OVERHEAD=45     # g. bench_overhead (its captured calls compile first)

dry=0
parts=abcdefg
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run)
            dry=1
            # CPU: slower, and the dry run is not timed; the limits only catch a hang.
            T_STEP_EAGER=300 T_COMPILE=300 T_KERNELS=120 T_STEP=400 T_GENERATION=120
            T_WHEELS=60 T_PEERS=300 T_OVERHEAD=180
            ;;
        --parts)
            parts=${2:-}
            if [[ ! $parts =~ ^[a-g]+$ ]]; then
                echo "gpu_check.sh: --parts takes letters a to g (the parts), not '$parts'" >&2
                exit 2
            fi
            shift
            ;;
        *) break ;;
    esac
    shift
done
results=${1:-benchmarks/results}
mkdir -p "$results"
log="$results/gpu_check.log"  # started by the header below
export PYTHONUNBUFFERED=1
if [ $dry = 0 ]; then
    # gbfunc.kernels is the folder kernels/ (pyproject's package-dir): an editable install maps it.
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
wanted() { [[ $parts == *$1* ]]; }
part() {  # a part's heading on a line of its own (the last output may lack its newline)
    printf '\n== %s, %s\n' "$*" "$(date -u '+%H:%M:%S UTC')" | tee -a "$log"
}
{
    echo "# bash benchmarks/gpu_check.sh $([ $dry = 1 ] && echo --dry-run) --parts $parts," \
        "$(date -u '+%Y-%m-%d %H:%M UTC')"
    [ $dry = 1 ] || nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$results/gpu_tests.log" "$log"
# The exit code of each part; "skipped" for a part not in --parts.
step_eager=skipped compile_tests=skipped tests=skipped step=skipped generation=skipped
peers=skipped overhead=skipped

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
gpu_step() {  # LIMIT MODE OUT [ARGS...]: gpu_step's steps of one mode
    local limit=$1 mode=$2 out=$3
    shift 3
    timeout -k 5 "$limit" python3 -m benchmarks.gpu_step \
        $([ $dry = 1 ] && echo --dry-run || echo --targets 10) --modes "$mode" --out "$out" "$@"
}

if wanted a; then
    part "a. gpu_step, eager"
    gpu_step $T_STEP_EAGER eager "$results/gpu_step_eager.md" 2>&1 | tee -a "$log"
    step_eager=${PIPESTATUS[0]}
fi

# b and c, in the background, each into its own log.
background=()
if wanted b; then
    part "b. compile tests, in the background"
    COMPILE_TESTS=(tests/kernels/test_compiled_step.py tests/kernels/test_backend.py -k compiles)
    if [ $dry = 1 ]; then  # the plumbing alone: the suite runs the compile tests on CPU itself
        COMPILE_ENV=(TRITON_INTERPRET=1)
        COMPILE_TESTS=(tests/kernels/test_compiled_step.py -k "notice")
    else
        COMPILE_ENV=()
        COMPILE_TESTS+=(-n 3)
    fi
    env "${COMPILE_ENV[@]}" timeout -k 5 $T_COMPILE python3 -m pytest -q -p no:randomly \
        -p no:benchmark --durations=5 "${COMPILE_TESTS[@]}" >"$results/gpu_tests_compile.log" 2>&1 &
    compile_pid=$!
    background+=($compile_pid)
fi
if wanted c; then
    part "c. the rest of the kernel tests, in the background"
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
    background+=($kernels_pid)
fi

if wanted d; then
    part "d. gpu_step, compiled"
    gpu_step $T_STEP compiled "$results/gpu_step.md" --wait-for "${background[@]}" 2>&1 \
        | tee -a "$log"
    step=${PIPESTATUS[0]}
fi
if wanted b; then
    wait $compile_pid
    compile_tests=$?
    summarise "compile tests" "$results/gpu_tests_compile.log" $compile_tests $T_COMPILE
fi
if wanted c; then
    wait $kernels_pid
    tests=$?
    summarise "the rest of the kernel tests" "$results/gpu_tests_kernels.log" $tests $T_KERNELS
fi

if wanted e; then
    part "e. bench_generation"
    if [ $dry = 1 ]; then
        timeout -k 5 $T_GENERATION python3 -m benchmarks.bench_generation --sizes 64 --budget 0.05 \
            --repeats 1 --out "$results/bench_generation_gpu.md" 2>&1 | tee -a "$log"
    else
        timeout -k 5 $T_GENERATION python3 -m benchmarks.bench_generation --skip-cpu \
            --gpu-sizes 8192 --out "$results/bench_generation_gpu.md" 2>&1 | tee -a "$log"
    fi
    generation=${PIPESTATUS[0]}
fi

if wanted f; then
    part "f. peers"
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
        echo "no wheels in $wheels (bash benchmarks/gpu_wheels.sh downloads them): the peers" \
            "run without hyper-nn and hypnettorch unless this python has them" | tee -a "$log"
    fi
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 $T_PEERS python3 -m benchmarks.peers \
        $([ $dry = 1 ] && echo --dry-run || echo --device cuda --quick) --out "$results" \
        --name peers_gpu 2>&1 | tee -a "$log"
    peers=${PIPESTATUS[0]}
fi

if wanted g; then
    part "g. bench_overhead"
    if [ $dry = 1 ]; then
        timeout -k 5 $T_OVERHEAD python3 -m benchmarks.bench_overhead --rounds 2 --inner 2 \
            --out "$results/bench_overhead_gpu.md" 2>&1 | tee -a "$log"
    else
        timeout -k 5 $T_OVERHEAD python3 -m benchmarks.bench_overhead --device cuda \
            --out "$results/bench_overhead_gpu.md" 2>&1 | tee -a "$log"
    fi
    overhead=${PIPESTATUS[0]}
fi

echo "gpu_step eager exit $step_eager, compile tests exit $compile_tests, kernel tests exit" \
    "$tests, gpu_step compiled exit $step, bench_generation exit $generation, peers exit" \
    "$peers, bench_overhead exit $overhead" | tee -a "$log"
for code in $step_eager $compile_tests $tests $step $generation $peers $overhead; do
    [ "$code" = 0 ] || [ "$code" = skipped ] || exit "$code"
done
