"""Ranks announce themselves (msdist/cluster/announce.py) and the relay takes only announced processes below its
command (msdist/launcher/relay.py): found by announcement, never by command line."""
import os
import signal
import subprocess
import sys

import pytest

from msdist.cluster import announce
from msdist.launcher import relay


def test_a_rank_announces_its_pid_and_start_time_and_records_its_exit_status(tmp_path, monkeypatch):
    monkeypatch.setenv(announce.RANKS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(announce, "_this_rank", {})
    announce.this_rank()
    me = announce.announced()[os.getpid()]
    assert me.alive and me.status is None and me.started == announce.start_time(os.getpid())
    announce.record(200)
    assert announce.announced()[os.getpid()].status == 200


def test_a_recycled_pid_is_not_the_rank_that_announced_it(tmp_path, monkeypatch):
    monkeypatch.setenv(announce.RANKS_DIR_ENV, str(tmp_path))
    (tmp_path / str(os.getpid())).write_text("1")   # another process's start time under this pid
    assert not announce.announced()[os.getpid()].alive


def test_the_relay_takes_announced_processes_below_its_command_only_whatever_their_command_line(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setenv(announce.RANKS_DIR_ENV, str(tmp_path))
    announcing = "from msdist.cluster import announce; announce.this_rank(); import time; time.sleep(60)"
    interpreter = tmp_path / "interp"
    interpreter.symlink_to(sys.executable)
    # A wrapper shell over a rank started as `interp -u -X dev -c ...`, and a silent process beside it.
    command = subprocess.Popen(["sh", "-c", f'"{interpreter}" -u -X dev -c "{announcing}" & sleep 60 & wait'],
                               env=dict(os.environ, PYTHONPATH=os.getcwd()), start_new_session=True)
    elsewhere = subprocess.Popen([sys.executable, "-c", announcing], env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        found = {}
        for _ in range(200):
            found = relay.ranks_below(command.pid)
            if found and len(announce.announced()) == 2:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        [(pid, rank)] = found.items()
        assert rank.alive and pid not in (command.pid, elsewhere.pid)   # neither the shell nor another tree's rank
        assert relay.mpiruns_below(command.pid, signal.SIGUSR2) == []
    finally:
        os.killpg(command.pid, signal.SIGKILL)
        elsewhere.kill()
        command.wait()
        elsewhere.wait()


_FAKE_RANK = """
import signal, sys, time
from msdist.cluster import announce
announce.this_rank()
def stop(*_):
    if sys.argv[1] == "saves":
        announce.record(200)
    sys.exit(200 if sys.argv[1] == "saves" else 1)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})   # the relay starts its command shielded
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.slow  # the relay and its stand-in ranks are processes of their own
@pytest.mark.parametrize("rank, status", [("saves", 200), ("fails", 1)])
def test_the_relay_exits_200_only_when_every_rank_it_told_recorded_200(tmp_path, rank, status):
    """A rank records 200 once the checkpoint is complete on every rank (msdist.train); a rank that ends without
    it (a failed save, a kill) makes the relay exit with a failure, naming it."""
    env = dict(os.environ, PYTHONPATH=os.getcwd(), **{announce.RANKS_DIR_ENV: str(tmp_path)})
    proc = subprocess.Popen([sys.executable, "-m", "msdist.launcher.relay", "--", "sh", "-c",
                             f'"{sys.executable}" -c \'{_FAKE_RANK}\' {rank}'], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert "told ranks [" in err and ("FAILED: the ranks did not all save" in err) == (status == 1)
