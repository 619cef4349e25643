"""The CPU loops' build (`gbfunc.cpu`): optional, switchable, loaded only from a private
cache; and the dispatcher's report of who generates what (`gb.explain`)."""

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gbfunc as gb
from gbfunc._dispatch import context_of, stack_path
from gbfunc.cpu import _build, _cache, _relu_loops
from gbfunc.generate import cpu_loops
from gbfunc.generate._policy import Call

# Run twice: without a C++ compiler on PATH, and as the machine is; the results must agree.
TRAINING_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    import torch
    from torch import nn
    from torch.func import functional_call
    import gbfunc as gb

    warnings.simplefilter("always", RuntimeWarning)  # gbfunc's fallbacks warn with these
    torch.manual_seed(0)
    genomes = {
        "default": (nn.Sequential(nn.Linear(128, 128)), {}, (None,)),
        "rows": (nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 10)),
                 dict(tile=(16, 16), hidden=8, outputs=16), (None, True)),
        "one output": (nn.Sequential(nn.Linear(40, 30)), dict(tile=(16, 16), hidden=8),
                       (None, True)),
        "hashed": (nn.Sequential(nn.Linear(40, 30)), dict(tile=(16, 16), hidden=4, hashed=7),
                   (None, True)),
    }
    results, paths = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        for name, (model, options, compiles) in genomes.items():
            plan = gb.plan(model, **options)
            x = torch.randn(4, model[0].in_features)
            for compile in compiles:
                gparams = gb.init(plan, seed=1)
                paths[name, compile] = gb.explain(gparams, plan, compile=compile).route.stacks
                params = gb.apply(gparams, plan, compile=compile)
                loss = functional_call(model, params, (x,)).square().mean()
                leaves = gb.trainable_leaves(gparams)
                grads = torch.autograd.grad(loss, leaves)
                with torch.no_grad():  # one SGD step, then the loss again
                    for leaf, g in zip(leaves, grads):
                        leaf -= 0.1 * g
                    after = functional_call(model, gb.apply(gparams, plan), (x,)).square().mean()
                results[name, compile] = (loss.detach(), grads, after)
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    torch.save({"results": results, "paths": paths, "warnings": messages}, sys.argv[1])
    """
)


def run_training(tmp_path, label: str, **env: str) -> dict:
    script, out = tmp_path / "train.py", tmp_path / f"{label}.pt"
    script.write_text(TRAINING_SCRIPT)
    dropped = ("CXX", "TRITON_INTERPRET", _build.MODE_VARIABLE)
    environment = {k: v for k, v in os.environ.items() if k not in dropped}
    environment.update(GBFUNC_CACHE_DIR=str(tmp_path / f"cache-{label}"), **env)
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="compares with the loops built")
def test_without_a_compiler_every_call_trains_with_one_warning_and_the_same_numbers(tmp_path):
    """The reproducer of issue 45 (`gb.apply` on `nn.Linear(128, 128)` with no C++ compiler on
    PATH raised from inductor's ISA probe), and a training step on every genome the loops
    take: no error, one warning naming the reason, and the numbers of a machine that has one."""
    bare = run_training(tmp_path, "bare", PATH="/nonexistent")
    built = run_training(tmp_path, "built")
    assert len(bare["warnings"]) == 1, bare["warnings"]
    assert "no C++ compiler" in bare["warnings"][0]
    assert built["warnings"] == []
    assert {path for paths in bare["paths"].values() for path in paths} == {"torch"}
    # The loops ran where a compiler was: the comparison is not torch against torch.
    assert "cpu-loops" in {path for paths in built["paths"].values() for path in paths}
    for key, (loss, grads, after) in built["results"].items():
        bare_loss, bare_grads, bare_after = bare["results"][key]
        torch.testing.assert_close(bare_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bare_after, after, rtol=1e-5, atol=1e-6)
        for g, h in zip(bare_grads, grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)


needs_loops = pytest.mark.skipif(
    _build.flavour() is None or _build.compiler() is None,
    reason="the loops are not built on this machine (mode, platform or compiler)",
)

PLANTED = Path(__file__).parent / "fixtures" / "planted_library.c"


@needs_loops
@pytest.mark.parametrize(
    "unsafe",
    [
        "world-writable folder",
        "folder of another user",
        "group-writable library",
        "world-writable folder above the cache",
    ],
)
def test_a_library_planted_in_an_unsafe_cache_is_never_loaded(unsafe, fresh_loops, tmp_path):
    """Another local user plants a library where the loops' build would be: whatever its
    name, it is not loaded (its constructor never runs); the loops are off, with one warning
    that names the unsafe path, and the call still works through torch."""
    if unsafe == "folder of another user" and os.getuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    units = 5
    parts = _build.build_folders("relu_unit_sums.cpp", units, 1, _build.flavour())
    leaf = fresh_loops.joinpath(*parts)
    leaf.mkdir(parents=True)
    for folder in [fresh_loops, *leaf.relative_to(fresh_loops).parents][::-1]:
        (fresh_loops / folder).chmod(0o700)
    marker = tmp_path / "constructor-ran"
    source = PLANTED
    library = leaf / f"{parts[-1]}.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)],
        check=True,
    )
    if unsafe == "world-writable folder":
        (fresh_loops / "cpu-loops").chmod(0o777)
        expected = "writable by group or others"
    elif unsafe == "folder of another user":
        os.chown(leaf, 65534, 65534)
        expected = "owned by user 65534"
    elif unsafe == "group-writable library":
        library.chmod(0o664)
        expected = "writable by group or others"
    else:  # another user could rename the cache away there and put a tree of theirs in its place
        tmp_path.chmod(0o777)
        expected = "above the cache folder"
    with pytest.warns(RuntimeWarning, match=expected):
        assert not _relu_loops.sums_usable(units, torch.float32, "cpu")
    assert not marker.exists()
    assert expected in _build.unavailable_reason()
    plan = gb.plan(nn.Linear(20, 12), tile=(8, 8), hidden=units)
    gparams = gb.init(plan, seed=0)
    refused = gb.explain(gparams, plan, compile=True).reasons[plan.stacks[0].key]
    assert expected in refused["cpu-loops"]
    gb.apply(gparams, plan, compile=False)["weight"].sum().backward()
    assert not marker.exists()


@needs_loops
def test_the_cache_is_private_and_follows_the_platforms_convention(fresh_loops, monkeypatch):
    monkeypatch.delenv(_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(fresh_loops))
    assert _cache.cache_root() == fresh_loops / "gbfunc"
    assert _relu_loops.sums_usable(6, torch.float32, "cpu")
    parts = _build.build_folders("relu_unit_sums.cpp", 6, 1, _build.flavour())
    folder = fresh_loops / "gbfunc"
    for part in ("", *parts):
        folder = folder / part if part else folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    library = folder / f"{parts[-1]}.so"
    assert _cache.unsafe_reason(library, directory=False) is None


@needs_loops
def test_portable_loops_build_without_isa_flags_and_compute_the_specification(fresh_loops):
    gb.cpu.set_mode("portable")
    try:
        assert _build.flavour() == "portable"
        units = 7
        gen = torch.Generator().manual_seed(0)
        g, threshold = torch.randn(3, 5, 9, generator=gen), torch.randn(3, 5, units, generator=gen)
        b = torch.randn(3, 9, units, generator=gen)
        assert _relu_loops.sums_usable(units, torch.float32, "cpu")
        rows, cols = _relu_loops.relu_unit_sums(g, threshold, b)
        want_rows, want_cols = _relu_loops.sums_reference(g, threshold, b)
        torch.testing.assert_close(rows, want_rows)
        torch.testing.assert_close(cols, want_cols)
        assert (
            fresh_loops.joinpath(*_build.build_folders("relu_unit_sums.cpp", units, 1, "portable"))
        ).is_dir()
    finally:
        gb.cpu.set_mode(None)


def test_the_switch_turns_the_loops_off_and_names_itself(fresh_loops, monkeypatch):
    monkeypatch.setenv(_build.MODE_VARIABLE, "off")
    assert gb.cpu.mode() == "off"
    assert not _relu_loops.sums_usable(8, torch.float32, "cpu")
    assert "GBFUNC_CPU_LOOPS" in gb.cpu.unavailable_reason()
    assert not any(fresh_loops.glob("**/*.so"))  # nothing built, nothing loaded
    plan = gb.plan(nn.Linear(20, 12), tile=(8, 8), hidden=8)
    report = str(gb.explain(gb.init(plan), plan, compile=True))
    assert "mode 'off'" in report
    monkeypatch.setenv(_build.MODE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="GBFUNC_CPU_LOOPS='fast'"):
        gb.cpu.mode()
    with pytest.raises(ValueError, match=r"set_mode: mode must be one of"):
        gb.cpu.set_mode("fast")


def row_gnets(**options) -> tuple[gb.Plan, dict]:
    """The plan of a two-layer MLP's row g-nets of one ReLU layer (or as `options` say), and
    their parameters."""
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, **{"tile": (16, 16), "hidden": 8, "outputs": 16, **options})
    return plan, gb.init(plan, seed=0)


def test_forward_mode_ad_routes_around_the_loops_and_gets_the_torch_paths_tangent():
    """Under a forward-mode dual level, `compile=True` took the loops (no forward-mode rule:
    `NotImplementedError`); the torch path's tile MLP has one."""
    import torch.autograd.forward_ad as fwAD

    plan, gparams = row_gnets()
    key = plan.stacks[0].key
    tangent = torch.randn_like(gparams["stacks"][key]["w_out"])
    changes = []
    for compile in (False, True):
        with fwAD.dual_level():
            dual = fwAD.make_dual(gparams["stacks"][key]["w_out"].detach(), tangent)
            stacks = {**gparams["stacks"], key: {**gparams["stacks"][key], "w_out": dual}}
            dual_gparams = {**gparams, "stacks": stacks}
            explained = gb.explain(dual_gparams, plan, compile=compile)
            assert explained.route.stacks == ("torch", "torch")
            if compile:
                assert "forward-mode AD" in explained.reasons[key]["cpu-loops"]
            weights = gb.apply(dual_gparams, plan, compile=compile)
            changes.append(fwAD.unpack_dual(weights["0.weight"]).tangent)
    torch.testing.assert_close(changes[1], changes[0])
    assert changes[0].abs().sum() > 0


def test_explain_names_each_stacks_path_and_why_the_others_were_not_taken():
    plan, gparams = row_gnets()
    off = gb.explain(gparams, plan, compile=False)
    variants = ("eager-recompute", "eager-recompute")
    assert off.route == ("stacks", ("torch", "torch"), variants, False)
    for stack in plan.stacks:
        assert off.reasons[stack.key]["graph"] == "compile=False"
        assert off.reasons[stack.key]["cpu-loops"] == "compile=False"
        assert "Triton for CUDA tensors" in off.reasons[stack.key]["triton"]
    text = str(off)
    assert text.splitlines()[0].startswith("gb.apply(backend='auto', compile=False) on cpu")
    assert f"stack {plan.stacks[0].key}: torch (eager-recompute)\n" in text
    assert "    not graph: compile=False" in text

    seen = {}

    def loss(gparams):
        seen["inside"] = gb.explain(gparams, plan, compile=True)
        return gb.apply(gparams, plan, compile=True)["0.weight"].sum()

    torch.func.grad(loss)(gparams)
    inside = seen["inside"]
    assert inside.route.stacks == ("torch", "torch")
    assert "inside a torch.func transform" in inside.reasons[plan.stacks[0].key]["cpu-loops"]
    assert "inside a torch.func transform" in str(inside).splitlines()[0]

    deep, deep_gparams = row_gnets(outputs=1, depth=2)
    assert gb.explain(deep_gparams, deep, compile=True).route[:2] == ("graph", ("graph", "graph"))
    with torch.no_grad():
        evaluation = gb.explain(deep_gparams, deep, compile=None)
    assert evaluation.route.plan == "stacks"
    assert "gradients off" in str(evaluation)
    with pytest.raises(ValueError, match="backend must be one of"):
        gb.explain(gparams, plan, backend="cuda")


@needs_loops
def test_explain_sends_one_layer_relu_gnets_to_the_loops_where_compiling_is_asked():
    plan, gparams = row_gnets()
    asked = gb.explain(gparams, plan, compile=True)
    assert asked.route == ("stacks", ("cpu-loops", "cpu-loops"), ("direct", "direct"), False)
    assert "no C++ compiler" not in str(asked)
    small = gb.explain(gparams, plan, compile=None)
    assert small.route.stacks == ("torch", "torch")
    assert "the plan is small" in small.reasons[plan.stacks[0].key]["cpu-loops"]
    # A selection (no plan, so no size rule) takes the loops eagerly only with compile=True.
    stack = plan.stacks[0]
    leaves = gparams["stacks"][stack.key]
    for compile, taken in ((None, "torch"), (True, "cpu-loops")):
        context = context_of({stack.key: leaves}, backend="auto", compile=compile)
        assert stack_path(stack, leaves, context, placed=True)[0] == taken
    selection = Call(None, stack, {stack.key: leaves}, context._replace(compile=None), True)
    assert "a selection takes them eagerly only with compile=True" in cpu_loops.refuses(selection)
    wide, wide_gparams = row_gnets(hidden=64)
    refused = gb.explain(wide_gparams, wide, compile=True).reasons[wide.stacks[0].key]
    assert "no loops for 64 units" in refused["cpu-loops"]


@needs_loops
def test_traced_inside_nested_transforms_the_loops_refuse_and_the_context_sees_it():
    """`torch.compile(grad(vmap(...)))` failed in the loops' ops (tests/test_compose.py runs
    it); the rule refuses the traced call there, and the context counts the transforms."""
    plan, gparams = row_gnets()
    stack = plan.stacks[0]
    leaves = gparams["stacks"][stack.key]
    seen = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(context_of({stack.key: leaves}, backend="auto", compile=True).nested)
        return x.sum()

    x = torch.ones(2, 3)
    torch.func.grad(record)(x)
    torch.func.grad(lambda x: torch.func.vmap(record)(x).sum())(x)
    assert seen == [False, True]
    context = context_of({stack.key: leaves}, backend="auto", compile=True)
    traced = Call(plan, stack, {stack.key: leaves}, context._replace(compiling=True), True)
    assert cpu_loops.refuses(traced) is None
    nested = traced._replace(context=traced.context._replace(transformed=True, nested=True))
    assert "nested torch.func transforms" in cpu_loops.refuses(nested)
