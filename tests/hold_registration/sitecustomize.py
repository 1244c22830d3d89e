"""Test-only (tests/integration/test_unregistered_rank.py): hold one rank back before it can register with MindSpore's
scheduler, the deterministic stand-in for the start-up race of issue #34. Nothing in msdist imports this.

With this folder on PYTHONPATH, Python runs this file at start-up in every process. Given
MSDIST_TEST_HOLD="RANK:SECONDS:MARKER", the first worker process of rank RANK (MS_NODE_ID under
msdist.launch, OMPI_COMM_WORLD_RANK under mpirun, RANK_ID under msrun) creates MARKER and sleeps
SECONDS before anything else runs; a rank started again afterwards (a respawn) finds MARKER and goes on.
"""
import os
import time


def _rank() -> str:
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return ""
    for name in ("MS_NODE_ID", "OMPI_COMM_WORLD_RANK", "RANK_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return ""


def _hold() -> None:
    spec = os.environ.get("MSDIST_TEST_HOLD", "")
    if not spec:
        return
    rank, seconds, marker = spec.split(":", 2)
    if _rank() != rank:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    time.sleep(float(seconds))


_hold()
