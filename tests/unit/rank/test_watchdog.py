"""rank/watchdog.py: the in-rank watchdog obeys the silence limit and runs under every launcher but
msdist.launch."""
import os
import socket
import subprocess
import time

from conftest import _write_beat
from msdist.cluster import heartbeat
from msdist.cluster.stall import StallPolicy


def test_the_watchdog_obeys_the_silence_limit_too(tmp_path):
    """A live process of this host whose heartbeat stopped changing is a stall past --stall_silence_timeout
    (after its first step) or --stall_startup_timeout (before it), as the launcher's supervisor decides; a
    rank whose process ended, or another host's, is left to its launcher and to the progress limit."""
    policy = StallPolicy(stall_timeout=1000.0, stall_startup_timeout=50.0, stall_silence_timeout=20.0,
                         stall_register_timeout=30.0)
    ended = subprocess.Popen(["true"])
    ended.wait()
    here, alive = socket.gethostname(), os.getpid()
    for epoch, silent_s, host, pid, stalled in ((4, 25, here, alive, True), (4, 15, here, alive, False),
                                                (0, 25, here, alive, False), (0, 55, here, alive, True),
                                                (4, 25, here, ended.pid, False), (4, 25, "elsewhere", alive, False)):
        tracker = heartbeat.Tracker({0: heartbeat.path_for(str(tmp_path), 0)})
        _write_beat(tmp_path, 0, epoch=epoch, phase="train step", phase_s=1.0, limit_s=1000.0, host=host, pid=pid,
                    time=time.time() + silent_s)
        tracker.poll()
        tracker._seen[0] = (tracker._seen[0][0], time.monotonic() - silent_s)
        assert (heartbeat.find_stall(tracker.poll(), policy) is not None) == stalled, (epoch, silent_s, host, pid)


def test_every_launcher_but_msdist_launch_gets_the_watchdog_inside_the_ranks():
    from msdist.base import launch_env
    from msdist.rank import watchdog
    on = StallPolicy.from_options({"stall_timeout": "auto"})
    envs = {
        "mpirun": {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
        "srun": {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "7"},
        "msrun": {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_NODE_ID": "1", "DEVICE_ID": "1", "RANK_SIZE": "2"},
        "msdist.launch": {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_NODE_ID": "1", "MSDIST_LOCAL_RANK": "1"},
        "standalone": {},
    }
    needed = {name: watchdog.needed(launch_env.detect_launch(env, parent=[]), on) for name, env in envs.items()}
    assert needed == {"mpirun": True, "srun": True, "msrun": True, "msdist.launch": False, "standalone": True}
    assert not watchdog.needed(launch_env.detect_launch(envs["srun"], parent=[]), StallPolicy.from_options({"stall_timeout": "0"}))
