"""The package's shape: import-linter's contracts (.importlinter), the module map, module size, and what
stays out of the package."""
import ast
import os
import shutil
import subprocess

from conftest import REPO

PACKAGE = os.path.join(REPO, "msdist")
MAX_MODULE_LINES = 400


def _module_paths() -> list:
    return [os.path.join(root, name) for root, _, files in os.walk(PACKAGE) for name in files if name.endswith(".py")]


def test_import_contracts_hold():
    """The layers point down (faces > run > engine | data > launcher | rank > cluster > base), the launcher
    never reaches MindSpore nor the rank runtime, models stands beside msdist, and
    no package's modules import each other in a cycle: `lint-imports` on this tree, every import counted."""
    lint_imports = shutil.which("lint-imports")
    assert lint_imports, "import-linter is missing: pip install -e '.[test]'"
    proc = subprocess.run([lint_imports, "--no-cache"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_architecture_doc_names_every_module():
    with open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8") as f:
        doc = f.read()
    missing = [path for path in (os.path.relpath(p, PACKAGE) for p in _module_paths())
               if not path.endswith("__init__.py") and os.path.basename(path) not in doc]
    assert missing == []


def test_no_module_is_over_the_size_bound():
    """A module that needs more lines than this holds more than one job (docs/architecture.md)."""
    sizes = {}
    for path in _module_paths():
        with open(path, encoding="utf-8") as f:
            sizes[os.path.relpath(path, REPO)] = sum(1 for _ in f)
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_train_is_wiring_and_the_package_ships_no_test_scaffolding():
    """train() stays wiring (at most 40 lines); the equivalence control and the overflow fault live outside msdist."""
    with open(os.path.join(PACKAGE, "train.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    [train] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert train.end_lineno - train.lineno + 1 <= 40
    assert not os.path.exists(os.path.join(PACKAGE, "control.py"))
    for path in _module_paths():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert "poison" not in text and "MSDIST_TEST_OVERFLOW" not in text, path


def test_the_cluster_launcher_and_rank_docstrings_list_every_module():
    """Each of the three packages cut by program says what it holds: one `- name:` line per module, no more."""
    for package in ("cluster", "launcher", "rank"):
        folder = os.path.join(PACKAGE, package)
        with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
            listed = [line[2:].split(":")[0] for line in ast.get_docstring(ast.parse(f.read())).splitlines()
                      if line.startswith("- ")]
        modules = sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py")
        assert sorted(listed) == modules, package
