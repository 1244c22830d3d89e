"""models/registry.py: model names are read from the `@register_model` functions without importing them."""
import os
import subprocess
import sys

from conftest import REPO


def test_model_names_are_the_register_model_functions_read_without_importing_them(tmp_path):
    """One source of truth: a family's names are its @register_model functions, read from its source, so a
    name is checkable before MindSpore (which every family module imports) loads."""
    (tmp_path / "family_x.py").write_text("import mindspore\nfrom models import registry\n\n\n"
                                          "@registry.register_model\ndef net_a(num_classes, **kwargs):\n    pass\n\n\n"
                                          "def _helper():\n    pass\n")
    code = ("import sys; from models import add_family, list_models; add_family('family_x'); names = list_models(); "
            "assert 'net_a' in names and '_helper' not in names and 'resnet50' in names, names; "
            "assert 'family_x' not in sys.modules and 'mindspore' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
