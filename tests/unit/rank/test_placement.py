"""Cores per rank (rank/runtime.py `split_shared_mask`, `assumed_masks`) and the per-host exchange through which
the local ranks learn each other's masks before MindSpore loads (rank/local_exchange.py)."""
import multiprocessing
import os

import pytest

from msdist.rank import local_exchange, runtime

Placement = runtime.Placement


def cores(first, count):
    return tuple(range(first, first + count))


def placements(masks, bind=True):
    return [runtime.split_shared_mask(rank, masks, bind) for rank in range(len(masks))]


def assert_no_core_idle_or_shared(masks, placed):
    used = [c for p in placed for c in p.cores]
    assert len(used) == len(set(used)), "a core is shared"
    assert set(used) == {c for mask in masks for c in mask}, "a core is idle"


# mpirun --bind-to socket (its default above 2 ranks) on 2 sockets x 32 cores, --map-by socket: ranks alternate.
SOCKETS = [cores(0, 32) if rank % 2 == 0 else cores(32, 32) for rank in range(8)]
# Slurm: the job's cgroup cpuset on this node, 24 of 64 cores, the same for its 4 tasks (no --cpu-bind).
SLURM_CPUSET = [cores(40, 24)] * 4
# A container limited to cores 4-11 (docker --cpuset-cpus=4-11), 3 ranks: 8 does not divide by 3.
CONTAINER_CPUSET = [cores(4, 8)] * 3
# mpirun --bind-to core (its default for up to 2 ranks) or srun --cpu-bind=cores: one core each.
CORE_BOUND = [(5,), (6,)]


@pytest.mark.parametrize("masks, expected", [
    (SOCKETS, [Placement(8, cores(8 * (r // 2) + 32 * (r % 2), 8), "msdist") for r in range(8)]),
    (SLURM_CPUSET, [Placement(6, cores(40 + 6 * r, 6), "msdist") for r in range(4)]),
    (CONTAINER_CPUSET, [Placement(3, cores(4, 3), "msdist"), Placement(3, cores(7, 3), "msdist"),
                        Placement(2, cores(10, 2), "msdist")]),
    (CORE_BOUND, [Placement(1, (5,), "launcher"), Placement(1, (6,), "launcher")]),
], ids=["sockets", "slurm cpuset", "container cpuset", "core-bound"])
def test_ranks_sharing_a_mask_split_that_mask_among_themselves(masks, expected):
    placed = placements(masks)
    assert placed == expected
    assert_no_core_idle_or_shared(masks, placed)


def test_socket_binding_no_longer_leaves_half_the_host_idle():
    """The issue's case: before, each rank took 1/8 of its socket (4 cores) and 32 of 64 cores idled."""
    assert sum(p.threads for p in placements(SOCKETS)) == 64


def test_unbound_threads_follow_the_same_split_and_a_lone_rank_keeps_everything():
    assert [p.threads for p in placements(CONTAINER_CPUSET, bind=False)] == [3, 3, 2]
    assert all(not p.cores for p in placements(CONTAINER_CPUSET, bind=False))
    assert runtime.split_shared_mask(0, [cores(0, 16)]) == Placement(16)
    assert runtime.split_shared_mask(5, [cores(0, 4)] * 8) == Placement(1)  # more ranks than cores: unbound


@pytest.mark.parametrize("mine, world, host, shared", [
    (cores(0, 64), 8, 64, True),     # unbound or one cpuset for all: shared by every local rank
    (cores(0, 32), 8, 64, True),     # a socket, without the others' masks: the old (pessimistic) guess
    ((3,), 2, 4, False),             # a core of its own: the launcher's binding
    (cores(0, 2), 2, 4, False),      # exactly its share
])
def test_a_rank_that_cannot_learn_the_others_masks_guesses(mine, world, host, shared):
    masks = runtime.assumed_masks(mine, 1, world, host)
    assert masks[1] == mine and len(masks) == world
    assert (masks.count(mine) == world) == shared


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


@pytest.mark.parametrize("launcher, job_id, env, key", [
    ("mpirun", "1500184577", {}, "1500184577"),
    ("srun", "4242.0", {}, "4242.0"),
    ("msdist.launch", "", SCHED, "10.0.0.1-29500"),
    ("msrun", "", SCHED, "10.0.0.1-29500"),
    ("msrun", "", {}, ""),                       # no scheduler address: nothing unique to meet under
    ("env", "", SCHED, ""),                      # set by hand: every rank counts as local, across hosts too
    ("", "", SCHED, ""),                         # standalone
])
def test_job_key(launcher, job_id, env, key):
    assert local_exchange.job_key(launcher, job_id, env) == key
