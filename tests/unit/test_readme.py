"""The README's two commands are the ones CI and users run."""
import os
import re

from conftest import REPO


def _readme_commands():
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_ci_runs_exactly_the_readme_test_command():
    demo, tests = _readme_commands()
    assert "run_demo.sh" in demo and "pytest" in tests
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().strip().splitlines()
    assert ci[-1] == tests


def test_readme_scripts_exist():
    for command in _readme_commands():
        for script in re.findall(r"scripts/[\w.]+\.sh", command):
            assert os.access(os.path.join(REPO, script), os.X_OK), script


def test_ci_installs_the_reference_extra_before_the_readme_test_command():
    """The torch reference tests skip where torch is absent; CI must not be such a place."""
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().strip().splitlines()
    assert ci.index('python3 -m pip install -q -e ".[reference]"') < len(ci) - 1
    setup = open(os.path.join(REPO, "setup.py"), encoding="utf-8").read()
    assert '"reference": ["torch==2.13.0", "torchvision==0.28.0"]' in setup
    # a runtime dependency: --pretrained reads .safetensors without torch
    assert '"safetensors"' in re.search(r"install_requires=\[([^]]*)\]", setup).group(1)
