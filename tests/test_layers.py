"""The layers stay layers: the decision side (core, tools over traces, cache bookkeeping) loads no MLX, and the
public names of `scheduler` resolve lazily.

Each module is imported in a fresh interpreter, because in this process the other tests have loaded MLX
already. A failure names the module and the first MLX-side modules it pulled in.
"""

import json
import subprocess
import sys

import pytest

# Modules that decide, or read traces, and must therefore run where no MLX is installed.
NO_MLX = [
    "scheduler",
    "scheduler.lifecycle",
    "scheduler.request",
    "scheduler.config",
    "scheduler.plan",
    "scheduler.policy",
    "scheduler.planner",
    "scheduler.scheduler",
    "scheduler.events",
    "scheduler.loop",
    "scheduler.fixtures.executors",
    "scheduler.tools.replay",
    "scheduler.tools.simulate",
    *(f"scheduler.tools.simulation.{m}" for m in ("cost_model", "recorded", "metrics", "executor", "driver", "report",
                                                  "what_if")),
    "scheduler.tools.workload",
    "scheduler.tools.timeline",
    "scheduler.tools.explain",
    "scheduler.tools.sweep",
    "caches.prefix",
]

FORBIDDEN_PREFIXES = ("mlx", "mlx_lm", "mlx_vlm", "transformers")


def _modules_after_import(module: str) -> list[str]:
    code = f"import json, sys, importlib; importlib.import_module({module!r}); print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", NO_MLX)
def test_decision_side_imports_no_mlx(module):
    loaded = _modules_after_import(module)
    heavy = [m for m in loaded if m.split(".")[0] in FORBIDDEN_PREFIXES]
    assert not heavy, f"importing {module} loaded {heavy[:8]}"


def test_public_names_resolve_lazily_and_unknown_names_raise():
    code = (
        "import sys, scheduler\n"
        "assert 'mlx' not in sys.modules\n"
        "from scheduler import EngineConfig, SamplingParams\n"
        "assert 'mlx' not in sys.modules, 'core names must not load MLX'\n"
        "from scheduler import Engine\n"
        "assert 'mlx.core' in sys.modules\n"
        "try:\n"
        "    scheduler.NoSuchName\n"
        "except AttributeError as e:\n"
        "    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised" in out.stdout and "NoSuchName" in out.stdout


def test_every_public_name_is_importable():
    import scheduler

    for name in scheduler.__all__:
        assert getattr(scheduler, name) is not None, name


def test_caches_and_kernels_never_import_scheduler():
    """caches/ and kernels/ sit below the scheduler: they are imported by it, never the other way, not even
    lazily inside a function (checked on the source, so a late import cannot hide)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in sorted([*root.glob("caches/*.py"), *root.glob("kernels/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "scheduler"]
    assert not offenders, offenders


def test_the_module_map_lists_every_module():
    """ARCHITECTURE.md's module map (one table per layer) names every module on disk, and nothing that is not."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Module map"):]
    listed = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            listed.update(re.findall(r"`([\w/]+\.py)`", first_cell))
    on_disk = {str(p.relative_to(root)) for pkg in ("scheduler", "caches", "kernels")
               for p in (root / pkg).rglob("*.py") if p.name != "__init__.py"}
    assert on_disk - listed == set(), f"modules missing from the map: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"the map lists modules that do not exist: {sorted(listed - on_disk)}"


NO_MLX_TESTS = "tests/core"  # the core's tests: they run where MLX is not importable


def test_the_core_tests_run_without_mlx():
    """`pytest tests/core` passes in an interpreter where every MLX-side package is unimportable (None in
    `sys.modules` makes `import mlx...` raise): a core test that needs MLX belongs in another layer's folder."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys\n"
        f"for name in {FORBIDDEN_PREFIXES!r}:\n"
        "    sys.modules[name] = None\n"
        "import pytest\n"
        # in this process (-n 0): workers would be fresh interpreters, where MLX imports
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-n', '0', {NO_MLX_TESTS!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "error" not in out.stdout.splitlines()[-1]
