#!/usr/bin/env bash
# The core tests under the oldest torch gbfunc claims (pyproject.toml's floor), with the Triton
# and NumPy the GPU machine has: torch 2.11.0, Triton 3.6.0 (the version torch 2.11 pins) and
# NumPy 2.4.6 (the GPU machine has 2.5, which PyPI did not offer when this was written).
#
#   bash benchmarks/compat.sh [VENV]     # default VENV: ${TMPDIR:-/tmp}/gbfunc-torch<version>
#
# Needs python3 (>= 3.11, with venv), network to PyPI for the first install (PyPI's torch 2.11
# for Linux is the CUDA build: about 5 GB with its nvidia-* wheels; no GPU is needed to run
# it) and about 2 minutes of install, then some 5 minutes of tests on 2 cores. A VENV that
# already holds the versions is reused as it is (pip finds nothing to do).
# Runs on CPU: the Triton kernels through Triton's interpreter (TRITON_INTERPRET=1), the
# compile tests with inductor's CPU backend. Not a CI job: CI gets 20 minutes on a fresh
# machine, and the CUDA torch download alone would take a large part of it.
#
# The tests: tests/kernels (the kernels against their references, forward, backward, vmap,
# second order, and the compiled whole step), and the core list CI runs again with the CPU
# loops off (.ci/run) plus tests/test_paths.py (every path and tile-MLP variant, compiled
# graphs included). Other versions: GBFUNC_COMPAT_TORCH, GBFUNC_COMPAT_TRITON and
# GBFUNC_COMPAT_NUMPY (the triton a torch wheel pins is in its metadata: `pip download
# torch==X --no-deps`, then Requires-Dist in the wheel's METADATA).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${GBFUNC_COMPAT_TORCH:-2.11.0}
TRITON=${GBFUNC_COMPAT_TRITON:-3.6.0}
NUMPY=${GBFUNC_COMPAT_NUMPY:-2.4.6}
venv=${1:-${TMPDIR:-/tmp}/gbfunc-torch$TORCH}
export PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# torch 2.11 wants setuptools < 82; a fresh venv's own setuptools may be too old to build an
# editable install (no bdist_wheel), hence the range.
"$py" -m pip install -q "torch==$TORCH" "triton==$TRITON" "numpy==$NUMPY" "setuptools>=70,<82" \
    "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100" "transformers>=4.40" "scikit-learn>=1.3" \
    "einops>=0.7" "safetensors>=0.4"
# gbfunc.kernels is the folder kernels/ (pyproject's package-dir): an editable install maps it.
"$py" -m pip install -q --no-deps --no-build-isolation -e .

export TRITON_INTERPRET=1  # before anything imports triton (tests/conftest.py sets it too)
"$py" - <<'EOF'
import sys, numpy, torch, triton
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")
EOF
CORE=(tests/test_apply.py tests/test_golden.py tests/test_tilemlp.py tests/test_compose.py
  tests/test_cpu_loops.py tests/test_relu_loops.py tests/test_relu_rows.py
  tests/test_hash_weights.py tests/test_hash_gradient.py tests/test_paths.py)
exec "$py" -m pytest -q -p no:randomly -n "${GBFUNC_COMPAT_WORKERS:-2}" tests/kernels "${CORE[@]}"
