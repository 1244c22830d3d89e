"""data/ and engine/ take plain values: no module there reads the training config namespace.

The rule, checked on each module's syntax tree (`ast`, so comments and strings never count):
the namespace `run.config.parse` returns is made in run/ and travels under the names `cfg` or
`config`, so a module of msdist/data/ or msdist/engine/
  1. imports nothing from msdist.run (where the namespace and its schema live);
  2. has no parameter (of a function, method or lambda) named `cfg` or `config`;
  3. has no variable, global or attribute named `cfg` or `config`;
  4. annotates nothing as `argparse.Namespace` (a namespace under another name).
The data face (`data/__main__.py`) parses its own command line with base.args; that namespace is built
in the module that reads it and is not the training config, so it is allowed.
What those layers need is resolved once in run/options.py into typed objects (`pipeline.TrainInput`,
`augment.Regularization`) or plain values.
"""
import ast
import os

import pytest

import msdist

PACKAGE = os.path.dirname(msdist.__file__)
LOWER_LAYERS = ("data", "engine")
NAMESPACE_NAMES = {"cfg", "config"}


def _imports_run(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "msdist.run" or a.name.startswith("msdist.run.") for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return node.module == "msdist.run" or node.module.startswith("msdist.run.") or \
            (node.module == "msdist" and any(a.name == "run" for a in node.names))
    return False


def _is_namespace_annotation(node) -> bool:
    text = ast.unparse(node) if node is not None else ""
    return text in ("argparse.Namespace", "Namespace")


def namespace_reads(source: str) -> list:
    """(line, what) for every place `source` breaks the rule in this module's docstring."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if _imports_run(node):
            found.append((node.lineno, "imports msdist.run"))
        elif isinstance(node, ast.arg) and (node.arg in NAMESPACE_NAMES or _is_namespace_annotation(node.annotation)):
            found.append((node.lineno, f"parameter {node.arg!r}"))
        elif isinstance(node, ast.Name) and node.id in NAMESPACE_NAMES:
            found.append((node.lineno, f"name {node.id!r}"))
        elif isinstance(node, ast.Attribute) and node.attr in NAMESPACE_NAMES:
            found.append((node.lineno, f"attribute {node.attr!r}"))
        elif isinstance(node, ast.AnnAssign) and _is_namespace_annotation(node.annotation):
            found.append((node.lineno, "a variable annotated argparse.Namespace"))
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and NAMESPACE_NAMES & set(node.names):
            found.append((node.lineno, "global cfg/config"))
    return found


def _lower_layer_modules():
    for layer in LOWER_LAYERS:
        folder = os.path.join(PACKAGE, layer)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                yield os.path.join(layer, name)


@pytest.mark.parametrize("module", list(_lower_layer_modules()))
def test_data_and_engine_never_read_the_config_namespace(module):
    with open(os.path.join(PACKAGE, module), encoding="utf-8") as f:
        found = namespace_reads(f.read())
    assert not found, f"msdist/{module} reads the config namespace: " + \
        ", ".join(f"line {line}: {what}" for line, what in found) + \
        "; resolve what it needs in msdist/run/options.py and pass that"


@pytest.mark.parametrize("source", [
    "def f(cfg):\n    return cfg.lr",
    "def f(*, config=None):\n    pass",
    "g = lambda cfg: 1",
    "def f(ns: argparse.Namespace):\n    return ns.lr",
    "def f(x):\n    return x.cfg.lr",
    "from msdist.run import config",
    "from msdist.run.options import train_input",
    "import msdist.run.config",
    "from msdist import run",
    "cfg = parse()",
])
def test_the_check_finds_each_way_in(source):
    assert namespace_reads(source), source


def test_the_check_passes_plain_values_and_a_face_s_own_command_line():
    source = ("def build(split, spec, epoch: int, skip_steps: int = 0):\n    return spec.image_size\n"
              "def main(argv=None):\n    args = parser().parse_args(argv)\n    return args.dir\n"
              "ms.set_auto_parallel_context(all_reduce_fusion_config=[1])\n")
    assert namespace_reads(source) == []
