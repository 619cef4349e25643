"""The kernels' source as inductor rebuilds it under `torch.compile` names only what it defines.

Inductor compiles a user-defined Triton kernel (the `triton_op` wrapper's `wrap_triton`) from
its source plus the `@triton.jit` functions, constants and triton names its globals hold;
anything reached through a module attribute is dropped. On an H200 (2026-11-28) that failed
every compiled step with `NameError: _gnet`; no CPU run compiles these kernels, so this test
rebuilds the source the way inductor does, checks that every global it loads resolves, and
compiles it for sm_90 as inductor's worker would (`hopper_compile.py`'s way, no GPU needed).
The interpreter's `@triton.jit` is not a `JITFunction`, so the check runs in a process
without `TRITON_INTERPRET` (defining kernels needs no GPU).
"""

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import builtins, dis, importlib.util, pathlib, tempfile
import triton
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as closure,
)
from gbfunc.kernels.generate import kernel as forward
from gbfunc.kernels.generate_backward import kernel as backward
from hopper_compile import compile_variant

def innermost(kernel):  # under @autotune and @heuristics
    while not isinstance(kernel, triton.JITFunction):
        kernel = kernel.fn
    return kernel

folder = pathlib.Path(tempfile.mkdtemp())
kernels = {"forward": forward._generate_kernel, "backward": backward._generate_backward_kernel}
for name, kernel in kernels.items():
    path = folder / f"rebuilt_{name}.py"
    # inductor's header, then its `@triton.jit` above the kernel's own source
    header = "import triton\\nimport triton.language as tl\\n\\n@triton.jit\\n"
    path.write_text(header + closure(innermost(kernel)))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jitted = [v for v in vars(module).values() if isinstance(v, triton.JITFunction)]
    assert innermost(kernel).__name__ in {f.__name__ for f in jitted}, name
    for function in jitted:
        for op in dis.Bytecode(function.fn):
            if op.opname == "LOAD_GLOBAL" and op.argval not in vars(module):
                assert hasattr(builtins, op.argval), (
                    f"{name}: {function.__name__} loads {op.argval!r}, which the rebuilt "
                    f"source does not define"
                )
    # What inductor's compile worker then does: Triton's compiler on the rebuilt function
    # (here for sm_90, with no GPU), two hidden layers and one output (every block in use).
    rebuilt = vars(module)[innermost(kernel).__name__]
    compile_variant(rebuilt, kernel.configs[0], "fp32", 1, 2, "gelu", "ieee", 8, 5, 17)
    print(name, len(jitted), "functions, compiled")
"""


def test_kernel_sources_are_self_contained(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        env=env,
        cwd=Path(__file__).parent,  # hopper_compile.py
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "forward" in result.stdout
    assert "backward" in result.stdout
