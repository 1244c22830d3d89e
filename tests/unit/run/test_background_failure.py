"""How a failed background write is named on every rank (background_save.BackgroundSaver.failure_error)."""
import errno
import os
from types import SimpleNamespace

from msdist.run.background_save import NO_FAILURE, BackgroundSaver, WriteFailure


def _saver(rank, directory="/runs/a/ckpt"):
    return BackgroundSaver(SimpleNamespace(directory=directory, prefix="resnet_tiny", rank=rank), collectives=None)


def test_every_rank_names_the_failing_ranks_file_error_and_room_from_the_gathered_rows():
    rows = [NO_FAILURE, (20.0, float(errno.ENOSPC), 0.25), (20.0, float(errno.EDQUOT), -1.0)]
    line = str(_saver(0).failure_error(rows, stop_step=23, steps_per_epoch=12))
    assert line == (
        "background save failed on rank(s) 1, 2; every rank stopped at global step 23: "
        "rank 1: background save of global step 20: writing checkpoint /runs/a/ckpt/resnet_tiny_rank1-2_8.ckpt "
        "failed: [Errno 28] No space left on device (0.2 MiB free there); "
        "rank 2: background save of global step 20: writing checkpoint /runs/a/ckpt/resnet_tiny_rank2-2_8.ckpt "
        f"failed: [Errno {errno.EDQUOT}] {os.strerror(errno.EDQUOT)} (free space unknown)")


def test_the_failing_rank_names_its_own_error_and_others_point_to_its_log():
    own = WriteFailure(1, 24, "/runs/a/ckpt/resnet_tiny_rank1-2_12.ckpt", 0, 3.0, "Failed to save the checkpoint")
    failing = _saver(1)
    failing.failure = own
    assert failing.failure_row() == (24.0, 0.0, 3.0)
    rows = [NO_FAILURE, own.row()]
    assert str(failing.failure_error(rows, 25, 12)).endswith("failed: Failed to save the checkpoint (3.0 MiB free "
                                                             "there)")
    assert str(_saver(0).failure_error(rows, 25, 12)).endswith("failed: the error is in rank 1's log (3.0 MiB free "
                                                               "there)")
