"""run/result.py: the result file."""
import json
import os

from msdist.run import result


def test_the_result_file_is_replaced_whole_never_rewritten_in_place(tmp_path, capsys):
    """A reader (the report, a launcher script) that opened result.json before the write still reads a whole
    file: the new one arrives by rename, so the old one is never truncated under it."""
    path = tmp_path / "result.json"
    path.write_text('{"accuracy": 0.25}')
    with open(path, encoding="utf-8") as reader:
        result.write_result(str(path), {"accuracy": 0.5, "correct": 1, "num_samples": 2, "loss": 0.7, "world_size": 1},
                            "msdist.train done", [], wall_seconds=3.0)
        assert json.load(reader) == {"accuracy": 0.25}
    assert json.loads(path.read_text())["accuracy"] == 0.5 and os.listdir(tmp_path) == ["result.json"]
    assert "== msdist.train done ==" in capsys.readouterr().out
