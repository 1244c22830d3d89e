"""run/checkpoint_sets.py: the newest complete checkpoint in a directory that holds files of 1-, 2- and 4-rank
jobs, old files without a recorded world size, and what pruning keeps while another rank's write is in flight."""
import json
import os

import numpy as np

from msdist.run import checkpoint, checkpoint_sets
from msdist.run.checkpoint_sets import CORRUPT, GOOD, MISSING, Key


def _write(directory, rank, global_step, world, recorded=True):
    """Rank `rank`'s checkpoint of `global_step` as a job of `world` ranks writes it (real file, real sha256)."""
    import mindspore as ms
    state = {"epoch": 1, "step": global_step, "global_step": global_step, "config_hash": "h"}
    if recorded:
        state[checkpoint.WORLD_KEY] = world
    params = [{"name": "w", "data": ms.Tensor(np.full((2, 3), global_step * 10 + rank, np.float32))}]
    return checkpoint.save(params, str(directory), "m", rank, state).path


def _job(directory, world, global_step, ranks=None, recorded=True):
    return [_write(directory, r, global_step, world, recorded) for r in (range(world) if ranks is None else ranks)]


def _choose(directory, world_size):
    """The choice a single process makes over everything it sees, hashing every file (`checkpoint.verify`)."""
    entries = checkpoint_sets.listing(str(directory), "m")
    everyone = range(8)
    return checkpoint_sets.newest_complete(checkpoint_sets.candidates(entries, world_size),
                                           lambda key: checkpoint_sets.statuses(entries, key, everyone))


def test_newest_complete_across_files_of_1_2_and_4_rank_jobs(tmp_path):
    _job(tmp_path, 2, 12)                        # a 2-rank job
    _job(tmp_path, 4, 24)                        # requeued on 4 ranks: complete at 24
    _job(tmp_path, 4, 36, ranks=[0, 1, 2])       # killed while rank 3 wrote 36
    corrupt = _job(tmp_path, 1, 48)[0]           # then 1 rank, whose newest file is damaged
    with open(corrupt, "r+b") as f:
        f.truncate(os.path.getsize(corrupt) // 2)
    for world in (1, 2, 4):                      # whatever world size resumes
        chosen, passed = _choose(tmp_path, world)
        assert chosen == Key(24, 4)
        assert [key for key, _ in passed] == [Key(48, 1), Key(36, 4)]
        assert passed[0][1] == "the files of ranks [0] fail their sha256 check"
        assert passed[1][1].startswith("ranks [3] have no file of it")


def test_a_rank_overwritten_by_a_job_of_another_size_does_not_roll_back(tmp_path):
    """The issue's case: files of an earlier 2-rank run under a 1-rank requeue. The old rule (the least of each rank's
    own newest step) resumed a 2-rank job from step 12; the newest complete checkpoint is the 1-rank job's 36."""
    _job(tmp_path, 2, 12)
    _job(tmp_path, 2, 24, ranks=[1])   # rank 0's file of 24 was overwritten below
    _job(tmp_path, 1, 24)
    _job(tmp_path, 1, 36)
    chosen, passed = _choose(tmp_path, 2)
    assert chosen == Key(36, 1) and passed == []
    assert checkpoint_sets.candidates(checkpoint_sets.listing(str(tmp_path), "m"), 2) == [
        Key(36, 1), Key(24, 2), Key(24, 1), Key(12, 2)]
    entries = checkpoint_sets.listing(str(tmp_path), "m")
    assert checkpoint_sets.statuses(entries, Key(24, 2), range(2)) == [MISSING, GOOD]


def test_old_files_without_a_world_size_are_the_world_of_the_ranks_beside_them(tmp_path):
    _job(tmp_path, 2, 18, recorded=False)   # as tests/data/old_checkpoint/topk2
    _job(tmp_path, 1, 6, recorded=False)    # as old_checkpoint/single
    entries = checkpoint_sets.listing(str(tmp_path), "m")
    assert checkpoint_sets.candidates(entries, 1) == [Key(18, 2), Key(6, 1)]
    assert _choose(tmp_path, 2) == (Key(18, 2), [])
    with open(checkpoint_sets.file_of(entries, Key(18, 2), 1).path, "r+b") as f:
        f.write(b"\xff" * 8)
    chosen, [(key, why)] = _choose(tmp_path, 2)
    assert chosen == Key(6, 1) and key == Key(18, 2) and "ranks [1] fail their sha256" in why


def test_the_statuses_of_several_views_combine_to_the_best_seen():
    assert checkpoint_sets.shortfall(np.max([[GOOD, MISSING], [MISSING, GOOD]], axis=0)) is None
    assert "ranks [1]" in checkpoint_sets.shortfall([GOOD, CORRUPT])


def test_pruning_keeps_the_checkpoint_a_resume_needs_while_another_ranks_write_is_in_flight(tmp_path):
    """keep_checkpoint_max 1: rank 0 wrote 20, rank 1 is still writing it; rank 0 keeps 10, the newest complete."""
    _job(tmp_path, 2, 10)
    newest = _write(tmp_path, 0, 20, 2)
    spare = checkpoint_sets.spared(str(tmp_path), "m", 0, 2)
    checkpoint.prune(str(tmp_path), "m", 0, keep=1, spare=spare)
    assert [c.position.global_step for c in checkpoint.list_checkpoints(str(tmp_path), "m", 0)] == [20, 10]
    _write(tmp_path, 1, 20, 2)   # rank 1's write lands: 20 is complete, 10 may go
    checkpoint.prune(str(tmp_path), "m", 0, keep=1, spare=checkpoint_sets.spared(str(tmp_path), "m", 0, 2))
    assert [c.path for c in checkpoint.list_checkpoints(str(tmp_path), "m", 0)] == [newest]


def test_pruning_where_the_other_ranks_files_are_not_seen_keeps_the_two_before_the_newest(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, 0, step, 2)   # rank 1 writes on its own node's disk
    checkpoint.prune(str(tmp_path), "m", 0, keep=1, spare=checkpoint_sets.spared(str(tmp_path), "m", 0, 2))
    assert [c.position.global_step for c in checkpoint.list_checkpoints(str(tmp_path), "m", 0)] == [40, 30, 20]


def test_the_sidecar_records_the_world_size_and_temporaries_are_removed_at_start(tmp_path):
    path = _write(tmp_path, 1, 5, 4)
    assert json.load(open(f"{path}.json"))[checkpoint.WORLD_KEY] == 4
    left = [tmp_path / f".{os.path.basename(path)}.tmp.ckpt", tmp_path / f".{os.path.basename(path)}.tmp.tmp",
            tmp_path / "m_rank1_best.ckpt.json.123.tmp", tmp_path / ".m_rank1_ema.ckpt.link.tmp"]
    other = tmp_path / ".m_rank0-1_5.ckpt.tmp.ckpt"   # another rank's write may be in flight: not this rank's
    for f in left + [other]:
        f.write_bytes(b"x")
    folder = tmp_path / ".m_rank1-2_5.ckpt.tmp.ckpt"   # a directory is nothing msdist wrote
    folder.mkdir()
    assert sorted(checkpoint.remove_temporaries(str(tmp_path), "m", 1)) == sorted(map(str, left))
    assert other.exists() and folder.is_dir() and os.path.exists(path)


def test_resume_auto_in_a_run_with_no_checkpoint_starts_fresh(tmp_path):
    """`--resume auto` on an empty or missing ckpt/ (every first start of a demo or a requeued job): nothing to
    agree on, no error. (resume_point's own name is tests/integration/test_resume_point.py's.)"""
    from msdist.rank.distributed import Collectives
    from msdist.run import resume_point

    assert resume_point.agree(str(tmp_path / "ckpt"), "resnet_tiny", 0, Collectives(1)) is None
    (tmp_path / "ckpt").mkdir()
    assert resume_point.agree(str(tmp_path / "ckpt"), "resnet_tiny", 0, Collectives(1)) is None
