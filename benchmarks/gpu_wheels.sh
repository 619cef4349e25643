#!/usr/bin/env bash
# The wheels that gpu_check.sh's peers part installs on a GPU machine with no package
# registry: downloads them here into .whl/ (git-ignored through .git/info/exclude), for the
# device tool to carry (`carry: [".whl"]`); gpu_check.sh installs them there with
# `pip install --no-index --no-deps --target` into a folder of their own on PYTHONPATH.
#
#   bash benchmarks/gpu_wheels.sh [DIR]    # default: .whl
#
# Two pure-Python wheels, about 0.5 MB:
# - hyper-nn 0.2.2: Requires-Dist numpy, torch, flax, jax; peers.py imports only its torch
#   part (hypernn.torch: torch, numpy).
# - hypnettorch 0.0.4: no Requires-Dist; its hnets and mnets import torch, numpy and
#   matplotlib (with pillow, cycler, python-dateutil, fonttools, kiwisolver, packaging,
#   pyparsing) and tqdm.
# The H200 image already holds every one of those dependencies (torch 2.11, numpy 2.5, jax,
# flax, matplotlib, ...: /work/.library/device/KINDS.md's package list), so none is
# downloaded. The platform flags are the device tool's README's, for its Python 3.12 on
# x86-64; pure-Python wheels match any of them.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
exclude=$(git rev-parse --git-path info/exclude)
if [ "$dir" = .whl ] && ! grep -qx '/.whl/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo /.whl/ >>"$exclude"
fi
mkdir -p "$dir"
${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" hyper-nn==0.2.2 hypnettorch==0.0.4
ls -l "$dir"
