"""The kernels compile for a GPU: Triton's compiler, not its interpreter, on a CPU machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_kernels_compile_for_a_hopper_gpu(tmp_path):
    # The interpreter runs a kernel as Python, so it accepts code the compiler rejects; this
    # compiles every constexpr branch for sm_90 (no GPU needed), in a process of its own since
    # this one runs the interpreter.
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env | {"TRITON_CACHE_DIR": str(tmp_path / "triton")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n\n".join(
        f"{variant}:\n{error}" for variant, error in failures.items()
    )
