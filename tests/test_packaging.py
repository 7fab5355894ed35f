"""What the tests and the package import is declared in pyproject.toml (a fresh machine gets it), and no test
skips on an import that must work (an in-repo module, or a declared dependency); the order hint in
tests/conftest.py names files that exist."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_REPO = {"scheduler", "caches", "kernels", "bench", "tests"}


def _imported_top_modules(paths) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"]) + [s for extra in project.get("optional-dependencies", {}).values()
                                             for s in extra]
    return {re.split(r"[\s<>=!~;\[]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_every_third_party_import_is_a_declared_dependency():
    files = [p for d in ("scheduler", "caches", "kernels", "tests") for p in (ROOT / d).rglob("*.py")]
    distributions = packages_distributions()
    declared = _declared()
    missing = {}
    for module, where in _imported_top_modules(files).items():
        if module in IN_REPO or module in sys.stdlib_module_names or module == "__future__":
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        if not dists & declared:
            missing[module] = (where, sorted(dists))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_no_test_skips_on_an_import_that_must_work():
    offenders = []
    for path in (ROOT / "tests").glob("*.py"):
        # every module the project uses is in-repo or declared (test above), so none may be skipped on
        offenders += [(path.name, name) for name in
                      re.findall(r"importorskip\(\s*[\"']([\w.]+)", path.read_text(encoding="utf-8"))]
    assert not offenders, f"importorskip hides an import error as a skip: {offenders}"


def test_the_longest_first_order_names_test_files_that_exist():
    """tests/conftest.py's LONGEST_FIRST (the order workers take the longest files in) names files on disk: a
    renamed file would silently drop back to the end of the run."""
    from tests.conftest import LONGEST_FIRST

    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
