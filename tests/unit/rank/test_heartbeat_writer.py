"""rank/heartbeat_writer.py: what a rank's heartbeat says about its loop (phase, position, limit, the loop
thread's state, a host-side collective on its stack)."""
import os
import threading
import time

import pytest

from msdist.cluster.stall import StallPolicy
from msdist.rank import heartbeat_writer
from conftest import REPO


def test_heartbeat_reports_phase_position_and_its_limit(tmp_path):
    beat = heartbeat_writer.Heartbeat(str(tmp_path), 3, StallPolicy.from_options({"stall_timeout": "20"}))
    assert beat.snapshot()["phase"] == "start-up" and beat.snapshot()["limit_s"] == 600
    beat.enter("compile")
    time.sleep(0.05)
    beat.enter("data wait")
    for gs in (1, 2, 3):
        beat.step_done(1, gs, gs)
        beat.enter("data wait")
    beat.enter("evaluation", batches=10)
    snap = beat.snapshot()
    assert (snap["rank"], snap["epoch"], snap["step"], snap["global_step"], snap["phase"]) == (3, 1, 3, 3, "evaluation")
    assert snap["phase_s"] < 1 and snap["median_step_s"] is not None
    compile_s = beat._measured["compile"]
    assert compile_s >= 0.05
    assert snap["limit_s"] == pytest.approx(20 + 3 * (10 * snap["median_step_s"] + compile_s), abs=0.2)


def test_the_heartbeat_reports_its_loop_threads_state(tmp_path):
    """Written from the heartbeat's thread about the thread that made it (the loop): asleep in a wait is "S"."""
    made, release, snaps = threading.Event(), threading.Event(), {}

    def loop():
        snaps["beat"] = heartbeat_writer.Heartbeat(str(tmp_path), 0, StallPolicy.from_options({}))
        snaps["running"] = snaps["beat"].snapshot()["loop_state"]
        made.set()
        release.wait()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        assert made.wait(10)
        deadline = time.monotonic() + 10
        while snaps["beat"].snapshot()["loop_state"] != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert snaps["running"] == "R" and snaps["beat"].snapshot()["loop_state"] == "S"
    finally:
        release.set()
        thread.join()


def test_the_heartbeat_sees_its_loop_inside_a_host_collective(tmp_path):
    beat = heartbeat_writer.Heartbeat(str(tmp_path), 0, StallPolicy.from_options({"stall_timeout": "auto"}))
    assert beat.snapshot()["in_collective"] is False
    # A function with Collectives.gather's name and file: the snapshot, taken inside it, finds it on the stack.
    scope = {}
    exec(compile("def gather(beat):\n    return beat.snapshot()\n",  # noqa: S102 - a frame named like the real one
                 os.path.join(REPO, "msdist", "rank", "distributed.py"), "exec"), scope)
    assert scope["gather"](beat)["in_collective"] is True
