"""Unit test files are named after the module they test (docs/testing.md, "Where a test lives"):
tests/unit/<layer>/test_<module>.py tests msdist/<layer>/<module>.py; faces/ tests msdist/<face>.py and models/
tests models/<module>.py, benchmarks/ tests benchmarks/<script>.py. A file of tests of several modules is named after the one they mainly test."""
import os

from conftest import REPO

UNIT = os.path.join(REPO, "tests", "unit")

# Topic files, only where no module's name fits, each with its reason.
TOPIC_FILES = {
    "faces/test_output_dir.py": "msdist/train.py's output-folder claim; test_train.py is "
                                "tests/integration/test_train.py's name, and basenames are unique (pytest.ini)",
    "faces/test_launch_command.py": "msdist/launch.py's command line; test_launch.py is tests/integration/'s name",
    "run/test_background_failure.py": "msdist/run/background_save.py's failure line; test_background_save.py is "
                                      "tests/integration/'s name",
    "launcher/test_mindspore_free.py": "the whole launcher package and the rank start-up, in a fresh interpreter: "
                                       "no one module",
}


def _tested_module(test_file: str) -> str:
    """The module `<layer>/test_<name>.py` (under tests/unit) is named after."""
    layer, name = test_file[:-len(".py")].split("/test_", 1)
    if layer in ("models", "benchmarks"):
        return os.path.join(REPO, layer, f"{name}.py")
    if layer == "faces":
        return os.path.join(REPO, "msdist", f"{name}.py")
    return os.path.join(REPO, "msdist", layer, f"{name}.py")


def _unit_test_files() -> list:
    return sorted(f"{layer}/{name}" for layer in os.listdir(UNIT) if os.path.isdir(os.path.join(UNIT, layer))
                  for name in os.listdir(os.path.join(UNIT, layer)) if name.startswith("test_") and name.endswith(".py"))


def test_every_unit_test_file_is_named_after_a_module_or_is_a_listed_topic():
    files = _unit_test_files()
    assert len(files) > 40  # the walk found the tree
    unnamed = [f for f in files if f not in TOPIC_FILES and not os.path.isfile(_tested_module(f))]
    assert unnamed == [], "rename each after the module it mainly tests, or list it in TOPIC_FILES with a reason"
    assert sorted(set(TOPIC_FILES) - set(files)) == []  # no stale entry
    # A topic file that a module's name now fits is renamed after it.
    assert [f for f in TOPIC_FILES if os.path.isfile(_tested_module(f))] == []
