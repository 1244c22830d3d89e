"""cluster/local_exchange.py: the per-host exchange through which the local ranks learn each other's core masks
before MindSpore loads (how they split them: test_runtime.py), and the job key they meet under."""
import multiprocessing
import os

import pytest

from msdist.rank import local_exchange


def _exchange_worker(folder, rank, world, value, out):
    out.put((rank, local_exchange.exchange(folder, rank, world, value, timeout_s=30)))


def test_local_ranks_learn_each_others_values_and_the_folder_is_removed(tmp_path):
    folder = str(tmp_path / "msdist-cores-77")
    queue = multiprocessing.get_context("fork").Queue()
    procs = [multiprocessing.get_context("fork").Process(target=_exchange_worker,
                                                         args=(folder, rank, 3, f"mask-{rank}", queue))
             for rank in (2, 0, 1)]  # arrival order does not matter
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert results == {rank: ["mask-0", "mask-1", "mask-2"] for rank in range(3)}
    assert not os.path.exists(folder)  # local rank 0 removed it once every rank had read


def test_a_rank_that_never_arrives_gives_none_in_time(tmp_path):
    assert local_exchange.exchange(str(tmp_path / "x"), 0, 2, "alone", timeout_s=0.2) is None


SCHED = {"MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "29500"}


@pytest.mark.parametrize("launcher, job_id, env, first, key", [
    ("mpirun", "1500184577", {}, 0, "1500184577"),
    ("srun", "4242.0", {}, 0, "4242.0"),
    ("msdist.launch", "", SCHED, None, "10.0.0.1-29500"),
    ("msrun", "", SCHED, None, "10.0.0.1-29500"),
    # Per node: nodes sharing a temp directory (containers, namespaces, several nodes on one host) meet apart.
    ("msdist.launch", "", SCHED, 4, "10.0.0.1-29500-node4"),
    ("msrun", "", SCHED, 2, "10.0.0.1-29500-node2"),
    # A rank respawned because it missed its registration: its peers left the exchange long ago.
    ("msdist.launch", "", {**SCHED, "MSDIST_RESPAWNED": "1"}, 0, ""),
    ("msrun", "", {}, 0, ""),                    # no scheduler address: nothing unique to meet under
    ("env", "", SCHED, 0, ""),                   # set by hand: every rank counts as local, across hosts too
    ("", "", SCHED, 0, ""),                      # standalone
])
def test_job_key(launcher, job_id, env, first, key):
    assert local_exchange.job_key(launcher, job_id, env, first) == key
