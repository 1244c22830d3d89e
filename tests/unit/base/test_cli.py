"""msdist.base.cli: what every `python -m msdist.*` main shares."""
import subprocess
import sys

import pytest

from conftest import REPO, base_env

# Counts the write(2) calls one print() of a rank's line makes (/proc/self/io: syscw), with and without cli_main.
_ONE_PRINT = """
import sys
from msdist.base.cli import cli_main

def writes():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["syscw"])

def print_a_line():
    before = writes()
    print("rank 0/2: all_gather(rank) -> [0, 1] [ok] | " + "x" * 250, flush=True)
    print("msdist: error: " + "y" * 250, file=sys.stderr, flush=True)
    counted = writes() - before
    with open(sys.argv[2], "w") as f:
        f.write(str(counted))
    return 0

sys.exit((cli_main(print_a_line) if sys.argv[1] == "wrapped" else print_a_line)())
"""


@pytest.mark.parametrize("face,writes", [("plain", 4), ("wrapped", 2)])
def test_each_console_line_is_one_write_even_unbuffered(face, writes, tmp_path):
    """Under PYTHONUNBUFFERED=1 a plain print() writes a line's text and its newline apart, so mpirun's merged
    output could join two ranks' lines (seen on CI: `msdist.check` under mpirun printed 1 line for 2 ranks).
    Every msdist main writes each line, to stdout and stderr, in one call."""
    counted = tmp_path / "writes"
    proc = subprocess.run([sys.executable, "-c", _ONE_PRINT, face, str(counted)], cwd=REPO,
                          env=dict(base_env(), PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("x" * 250 + "\n") and proc.stderr.endswith("y" * 250 + "\n")
    assert int(counted.read_text()) == writes
