"""`torchrun` of an example module or a script on local gloo ranks, from the tests."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(
    tmp_path: Path,
    target: str,
    *args: str,
    max_restarts: int = 0,
    nproc: int = 2,
    cwd: Path | None = None,
) -> str:
    """Run `python -m target *args` (or the script `target`, a path ending in `.py`) under
    torchrun on `nproc` ranks on 127.0.0.1, in `cwd`; its output (it must exit 0)."""
    with socket.socket() as s:  # a free port on loopback for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        # gloo on CPU on a GPU host too: with CUDA visible, `init_mesh` would start NCCL with
        # one GPU per rank, which two ranks on a one-GPU machine do not have.
        "CUDA_VISIBLE_DEVICES": "",
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    command += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    command += [f"--max-restarts={max_restarts}"]
    command += [target] if target.endswith(".py") else ["-m", target]
    done = subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr
