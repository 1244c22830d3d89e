"""Stall detection by progress (cluster/stall.py, heartbeat.py): the one option family, the auto limits and the
verdict read from the heartbeats."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from msdist.base.errors import ConfigError
from msdist.cluster import heartbeat
from msdist.cluster.stall import StallPolicy
from msdist.rank import heartbeat_writer
from conftest import _write_beat


def test_stall_timeout_values():
    assert StallPolicy.from_options({"stall_timeout": "auto"}).stall_timeout is None
    assert StallPolicy.from_options({"stall_timeout": "0"}).stall_timeout == 0
    assert StallPolicy.from_options({"stall_timeout": "45"}).stall_timeout == 45
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ConfigError, match="--stall_timeout .* must be auto, 0 .off. or seconds > 0"):
            StallPolicy.from_options({"stall_timeout": bad})



def test_one_option_family_for_the_launcher_and_the_ranks(capsys):
    """msdist.train and msdist.launch read the same --stall_* options into the same policy; the old names
    still work, each with a one-line notice naming the new one."""
    from msdist import launch
    from msdist.run import config
    cfg = config.parse(["--stall_timeout", "30", "--stall_startup_timeout", "90", "--stall_silence_timeout", "15"])
    expected = StallPolicy(30.0, 90.0, 15.0, 30.0)
    assert StallPolicy.from_options(vars(cfg)) == expected
    plan = launch.parse_args(["-n", "2", "--stall_timeout", "30", "--stall_startup_timeout", "90",
                              "--stall_silence_timeout", "15"])
    assert plan.stall == expected
    capsys.readouterr()
    old = launch.parse_args(["-n", "2", "--stall_timeout", "30", "--startup_timeout", "90", "--heartbeat_timeout=15"])
    assert old.stall == expected
    notices = capsys.readouterr().err.splitlines()
    assert notices == ["msdist: --startup_timeout is now --stall_startup_timeout (docs/launch.md#stall-options)",
                       "msdist: --heartbeat_timeout is now --stall_silence_timeout (docs/launch.md#stall-options)"]
    assert "--stall_silence_timeout=15" in old.train_args and "--heartbeat_timeout=15" not in old.train_args
    with pytest.raises(ConfigError, match=r"--stall_silence_timeout 0(\.0)? must be a number of seconds > 0"):
        config.parse(["--stall_silence_timeout", "0"])


def _limit(policy, phase, **kw):
    args = dict(median_step_s=None, warm=True, expected_s=0.0, measured_s=0.0, compile_s=0.0)
    args.update(kw)
    return StallPolicy.from_options({"stall_timeout": policy}).limit(phase, **args)


def test_auto_limits_cover_the_slow_but_healthy_cases():
    # max(300 s, 10x the median step)
    assert _limit("auto", "data wait", median_step_s=0.5) == 300
    assert _limit("auto", "train step", median_step_s=45.0) == 450
    assert _limit("0", "data wait") is None
    # A long first compile: six timeouts (30 min), at least 10 min, and the first steps the compile time thrice.
    assert _limit("auto", "compile") == 1800 and _limit("auto", "start-up") == 1800
    assert _limit("8", "compile") == 600 and _limit("200", "start-up") == 1200
    assert _limit("auto", "train step", warm=False, compile_s=400) == 300 + 3 * 400
    # The loop's collectives between steps wait for the ranks still compiling too.
    assert _limit("10", "stop check", warm=False, compile_s=40) == _limit("10", "epoch end", warm=False, compile_s=40) \
        == 10 + 3 * 40
    # Evaluating a 17k-image Test split on 2 ranks, 32 per batch, at ResNet-50's 2 s step:
    # 265 batches -> expected 530 s, allowed 300 + 3 x 530.
    batches = 17000 // 2 // 32
    assert _limit("auto", "evaluation", median_step_s=2.0, expected_s=batches * 2.0) == 300 + 3 * batches * 2.0
    # Saving ResNet-50 (25.6 M weights + momentum, float32: 205 MB) at a slow disk's 10 MB/s: 20 s expected.
    nbytes = 25_600_000 * 4 * 2
    assert _limit("auto", "checkpoint save", expected_s=nbytes / heartbeat_writer.SLOW_DISK_BYTES_PER_S) >= 300 + 60
    # A save measured slower than expected before gets its measured time.
    assert _limit("60", "checkpoint save", expected_s=1.0, measured_s=50.0) == 60 + 150


def test_the_verdict_names_the_rank_that_holds_the_others_up(tmp_path):
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(4)})
    for rank in (0, 2, 3):
        _write_beat(tmp_path, rank, phase_s=61.0)
    _write_beat(tmp_path, 1, phase="data wait", phase_s=62.0)
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert stall is not None and stall.rank == 1
    assert stall.line() == "rank 1 (host a) stuck in data wait at step 37 for 62 s; ranks 0, 2, 3 waiting in step 38"
    assert stall.record()["rank"] == 1 and stall.record()["phase"] == "data wait"
    # Below every limit: no verdict.
    for rank in range(4):
        _write_beat(tmp_path, rank, phase_s=5.0, time=time.time() + rank)
    assert heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({})) is None


def test_the_rank_behind_and_a_silent_rank_are_blamed(tmp_path):
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(2)})
    _write_beat(tmp_path, 0, phase_s=70.0, global_step=38)    # waits in step 39 longer than rank 1 is stuck
    _write_beat(tmp_path, 1, phase="train step", phase_s=3.0)
    assert heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({})).rank == 1
    # Same step and phase: the rank whose heartbeat stopped changing is the one stopped.
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(2)})
    _write_beat(tmp_path, 0, phase_s=70.0, global_step=37)
    _write_beat(tmp_path, 1, phase_s=3.0)
    tracker.poll()
    tracker._seen[1] = (tracker._seen[1][0], time.monotonic() - 30)   # no new beat from rank 1 for 30 s
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert stall.rank == 1 and "no heartbeat for 30 s" in stall.line()


def test_in_the_same_phase_the_rank_not_waiting_in_a_collective_is_blamed(tmp_path):
    # Rank 0 reached the save's BatchNorm collective first and waits there longer than rank 1, which froze
    # before reaching it: rank 1 holds the job up.
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(2)})
    _write_beat(tmp_path, 0, phase="checkpoint save", phase_s=70.0, global_step=12, in_collective=True)
    _write_beat(tmp_path, 1, phase="checkpoint save", phase_s=65.0, global_step=12, in_collective=False)
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert stall.line() == ("rank 1 (host a) stuck in checkpoint save at step 12 for 65 s; "
                            "rank 0 waiting in checkpoint save at step 12")


def test_a_rank_still_between_steps_is_behind_one_in_the_next_step(tmp_path):
    # Seen on CI: rank 1 froze inside the stop check after step 19 once its part of the AllGather was done, so
    # rank 0 went on into step 20 and waited there, in its phase longer. Rank 1 is behind: it is named.
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(2)})
    _write_beat(tmp_path, 0, phase="train step", phase_s=64.0, global_step=19)
    _write_beat(tmp_path, 1, phase="stop check", phase_s=62.0, global_step=19, in_collective=True)
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert stall.line() == "rank 1 (host a) stuck in stop check at step 19 for 62 s; rank 0 waiting in step 20"


def test_a_rank_whose_main_thread_is_stopped_is_not_waiting_for_the_others(tmp_path):
    # Both in step 38, rank 0 there longer (it arrived first, then rank 1 froze before its part of the
    # all-reduce): the kernel's state of rank 1's main thread tells them apart.
    tracker = heartbeat.Tracker({r: heartbeat.path_for(str(tmp_path), r) for r in range(2)})
    _write_beat(tmp_path, 0, phase_s=70.0, loop_state="S")
    _write_beat(tmp_path, 1, phase_s=65.0, loop_state="t")
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert stall.line() == ("rank 1 (host a) stuck in train step at step 37 for 65 s (its main thread is stopped by "
                            "a debugger); rank 0 waiting in step 38")
    _write_beat(tmp_path, 1, phase_s=66.0, loop_state="D", time=time.time() + 1)
    stall = heartbeat.find_stall(tracker.poll(), StallPolicy.from_options({}))
    assert "(its main thread is in uninterruptible I/O" in stall.line()


def test_a_reader_on_the_same_host_sees_the_main_threads_state_afresh(tmp_path):
    """A main thread frozen while it holds the Python lock silences the heartbeat thread too, so the last beat
    still says "S" (seen once in the mpirun frozen-rank test): the reader reads the state from /proc itself."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tracker = heartbeat.Tracker({0: heartbeat.path_for(str(tmp_path), 0)})
        _write_beat(tmp_path, 0, host=socket.gethostname(), pid=child.pid, loop_tid=child.pid, loop_state="S")
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while tracker.poll()[0].beat["loop_state"] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tracker.poll()[0].beat["loop_state"] == "T"
        # Another host's thread cannot be read from here: its beat is taken as written.
        _write_beat(tmp_path, 0, host="elsewhere", pid=child.pid, loop_tid=child.pid, loop_state="S",
                    time=time.time() + 1)
        assert tracker.poll()[0].beat["loop_state"] == "S"
    finally:
        child.kill()
        child.wait()


def test_a_previous_runs_heartbeat_is_ignored_until_it_changes(tmp_path):
    _write_beat(tmp_path, 0, phase_s=1000.0)
    tracker = heartbeat.Tracker({0: heartbeat.path_for(str(tmp_path), 0)})
    assert tracker.poll() == []
    _write_beat(tmp_path, 0, phase_s=1.0)
    assert [s.rank for s in tracker.poll()] == [0]
