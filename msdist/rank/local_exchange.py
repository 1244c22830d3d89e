"""What the ranks on one host tell each other before any collective exists: a per-host file exchange.

Two start-up decisions need the other local ranks' facts at a time when no communication group
exists yet:

* before MindSpore loads, each rank's CPU affinity mask (`runtime.place_rank`: ranks that share a
  mask split it among themselves only);
* once MindSpore has loaded and before `init("nccl")`, the PCI bus id of the GPU each rank will use
  (`device.shared_gpu`: two local ranks on one GPU stop NCCL with "Duplicate GPU detected").

Each local rank writes its value to `<tmp>/msdist-<topic>-<job key>/<local rank>` (atomically) and
reads the others' files. The folder lives in the host's temp directory, so only the ranks of one
host (one container, for a pod) meet there; the job key (`job_key`) keeps two jobs on one host
apart. Once every rank has read every value, each says so (`read-<local rank>`) and local rank 0
removes the folder.
"""
import os
import re
import shutil
import tempfile
import time
from typing import List, Mapping, Optional

from msdist.base.files import atomic_write_text
from msdist.cluster.registration import RESPAWNED_VAR

# Ranks reach these points within seconds of each other (they start together); a rank that does not
# arrive in this time is stuck or dead, and the caller falls back to what it knows alone.
EXCHANGE_TIMEOUT_S = 60.0
_POLL_S = 0.02


def job_key(launcher: str, job_id: str, env: Mapping[str, str], node_first_rank: Optional[int] = None) -> str:
    """A name every rank of this job computes alike and another job on the host does not ("" = none).

    mpirun and srun give a job id; msdist.launch and msrun give their scheduler's address, which is
    unique on a host while the job runs, and the node's first rank (`LaunchEnv.rank - LaunchEnv.local_rank`):
    the nodes of one job meet under one address, and where several share a temp directory (nodes on one machine,
    in network namespaces or containers sharing /tmp) each needs its own folder, or their local ranks of one number
    overwrite each other's values and wait out the timeout. Ranks set up by hand (launcher "env") count every rank
    as local, so they would wait for ranks on other hosts: no key. Nor has a rank msdist.launch started again
    because it did not register: its local ranks exchanged before and would never answer (the respawn would wait
    out EXCHANGE_TIMEOUT_S and miss its registration again).

    Args:
        launcher: `LaunchEnv.launcher`; job_id: `LaunchEnv.job_id`.
    """
    if env.get(RESPAWNED_VAR):
        return ""
    if job_id:
        key = job_id
    elif launcher in ("msdist.launch", "msrun") and env.get("MS_SCHED_PORT"):
        node = "" if node_first_rank is None else f"-node{node_first_rank}"
        key = f"{env.get('MS_SCHED_HOST', '')}-{env['MS_SCHED_PORT']}{node}"
    else:
        return ""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def folder_for(topic: str, key: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"msdist-{topic}-{key}")


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def exchange(folder: str, local_rank: int, local_world_size: int, value: str,
             timeout_s: float = EXCHANGE_TIMEOUT_S) -> Optional[List[str]]:
    """Every local rank's `value`, indexed by local rank; None when a rank did not arrive within `timeout_s`.

    Args:
        folder: `folder_for(topic, job_key(...))`, the same on every local rank.
        value: this rank's value (one line of text).
    """
    os.makedirs(folder, exist_ok=True)
    atomic_write_text(os.path.join(folder, str(local_rank)), value)
    deadline = time.monotonic() + timeout_s
    while True:
        values = [_read(os.path.join(folder, str(rank))) for rank in range(local_world_size)]
        if all(v is not None for v in values):
            break
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    _done(folder, local_rank, local_world_size, deadline)
    return values


def _done(folder: str, local_rank: int, local_world_size: int, deadline: float) -> None:
    """Say this rank has read everything; local rank 0 removes the folder once every rank has."""
    atomic_write_text(os.path.join(folder, f"read-{local_rank}"), "")
    if local_rank != 0:
        return
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(folder, f"read-{rank}")) for rank in range(local_world_size)):
            shutil.rmtree(folder, ignore_errors=True)
            return
        time.sleep(_POLL_S)
