"""`--resume auto` across a change of world size (issue 33): every rank resumes from rank 0's newest good
checkpoint when some rank has none of its own, with the rank-local residuals dropped and one line saying so.
Real msdist.launch jobs in one output folder: 1 rank, then 2 (grown), then 1 again (shrunk), then 2 again: the
files rank 1 kept from the 2-rank run no longer roll the job back (issue 41)."""
import os
import re

import pytest

from msdist.run import checkpoint
from test_launch import DATA_DIR, TINY_CONFIG, Job

ARGS = ["--config", TINY_CONFIG, "--data_dir", DATA_DIR, "--batch_size", "16", "--log_every", "6",
        "--grad_compression", "topk", "--topk_ratio", "0.1"]
STEPS_PER_EPOCH = 12   # 192 images, global batch 16, whatever the world size


def _log(job, rank) -> str:
    with open(os.path.join(job.output_dir, "logs", f"rank_{rank}.log"), encoding="utf-8") as f:
        return f.read()


def _newest_step(job, rank) -> int:
    return checkpoint.latest_good(os.path.join(job.output_dir, "ckpt"), "resnet_tiny", rank).position.global_step


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_grown_job_resumes_from_rank_0s_checkpoint_and_a_shrunk_one_from_its_own(tmp_path):
    first = Job(tmp_path, "one_rank", ["-n", "1"], ARGS + ["--epochs", "2"], output_name="run")
    assert first.wait() == 0, first.stderr()
    assert _newest_step(first, 0) == 2 * STEPS_PER_EPOCH

    grown = Job(tmp_path, "grown", ["-n", "2"], ARGS + ["--epochs", "3", "--resume", "auto"], output_name="run")
    assert grown.wait() == 0, grown.stderr()
    for rank in (0, 1):
        log = _log(grown, rank)
        assert re.search(r"resume auto: ranks \[1\] have no checkpoint of their own .* every rank resumes from "
                         r"rank 0's newest good checkpoint \S+resnet_tiny_rank0-2_12.ckpt \(global step 24\); "
                         r"rank-local gradient-compression residuals are dropped", log), log[-3000:]
        assert "resumed from" in log and "global step 24" in log
        assert _newest_step(grown, rank) == 3 * STEPS_PER_EPOCH   # not a fresh start: it trained one more epoch

    shrunk = Job(tmp_path, "shrunk", ["-n", "1"], ARGS + ["--epochs", "4", "--resume", "auto"], output_name="run")
    assert shrunk.wait() == 0, shrunk.stderr()
    log = _log(shrunk, 0)
    assert "resumed from" in log and "global step 36" in log and log.count("no checkpoint of their own") == 1
    assert _newest_step(shrunk, 0) == 4 * STEPS_PER_EPOCH

    # Rank 1's newest files are the grown run's (global step 36), rank 0's the shrunk one's (48): the least of the
    # ranks' newest steps went back to 36; the newest complete checkpoint is the 1-rank run's at 48.
    assert _newest_step(shrunk, 1) == 3 * STEPS_PER_EPOCH
    again = Job(tmp_path, "again", ["-n", "2"], ARGS + ["--epochs", "5", "--resume", "auto"], output_name="run")
    assert again.wait() == 0, again.stderr()
    log = _log(again, 0)
    assert re.search(r"resume auto: chose global step 48 \(written by 1 rank\), batch layout \d+ slots, in \S+: the "
                     r"newest complete checkpoint", log), log[-3000:]
    assert re.search(r"ranks \[1\] have no checkpoint of their own at global step 48 .* every rank resumes from rank "
                     r"0's newest good checkpoint \S+resnet_tiny_rank0-4_12.ckpt", _log(again, 1))
    for rank in (0, 1):
        assert _newest_step(again, rank) == 5 * STEPS_PER_EPOCH
