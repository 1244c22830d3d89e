"""MPI finalisation for real: mpirun exits 0 after a rank leaves with os._exit."""
import ctypes
import subprocess
import sys

import pytest

from conftest import REPO, base_env


_MPI_PROGRAM = """
import ctypes, os, sys
from msdist.rank import distributed
mpi = ctypes.CDLL("libmpi.so.40", mode=ctypes.RTLD_GLOBAL)
mpi.MPI_Init(None, None)
if sys.argv[1] == "finalize":
    assert distributed.finalize_mpi()
os._exit(0)
"""


@pytest.mark.multiprocess
@pytest.mark.multiprocess
def test_finalize_mpi_lets_mpirun_exit_0_after_os_exit():
    """What MindSpore's GPU path does (MPI_Init in-process, then msdist's os._exit), with and without
    distributed.finalize_mpi(): only with it does mpirun count the exit as clean."""
    try:
        ctypes.CDLL("libmpi.so.40")
    except OSError:
        pytest.skip("OpenMPI's libmpi.so.40 is not installed")
    status = {}
    for mode in ("finalize", "skip"):
        proc = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", _MPI_PROGRAM, mode],
                              cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
        status[mode] = (proc.returncode, proc.stdout + proc.stderr)
    assert status["finalize"][0] == 0, status["finalize"][1]
    assert status["skip"][0] != 0, status["skip"][1]
