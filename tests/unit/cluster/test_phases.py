"""cluster/phases.py: the heartbeat's phase names are written once, in the enum, and keep their file format."""
import ast
import json
import pathlib

from conftest import REPO
from msdist.cluster.phases import Phase


def test_a_phase_is_written_and_read_back_as_its_plain_name():
    assert json.loads(json.dumps({"phase": Phase.TRAIN_STEP})) == {"phase": "train step"}
    assert "train step" == Phase.TRAIN_STEP and "data wait" in (Phase.DATA_WAIT,)
    assert f"stuck in {Phase.CHECKPOINT_SAVE}" == "stuck in checkpoint save" == "stuck in " + str(Phase.CHECKPOINT_SAVE)
    assert Phase("epoch end") is Phase.EPOCH_END


def test_no_phase_name_is_spelled_out_in_the_package():
    """Every phase is named through `Phase`: a string literal equal to a phase name anywhere else in msdist/
    (code, not docstrings) is a second spelling that can drift from the one the stall policy compares with."""
    names = {p.value for p in Phase}
    defining = pathlib.Path(REPO, "msdist", "cluster", "phases.py")
    found = []
    for path in sorted(pathlib.Path(REPO, "msdist").rglob("*.py")):
        if path == defining:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "use msdist.cluster.phases.Phase:\n" + "\n".join(found)
