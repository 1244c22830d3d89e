"""run/checkpoint.py: a corrupt newest checkpoint falls back to the previous one, a kill during save leaves
the previous one loadable, pruning keeps this rank's newest."""
import os

import numpy as np

from msdist.run import checkpoint


def _save_tiny(directory, epoch, value, rank=0):
    import mindspore as ms
    params = [{"name": "w", "data": ms.Tensor(np.full((2, 3), value, np.float32))}]
    return checkpoint.save(params, directory, "m", rank, {"epoch": epoch, "step": 5, "global_step": epoch * 5,
                                                          "config_hash": "h"})


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    first = _save_tiny(str(tmp_path), 1, 1.0)
    newest = _save_tiny(str(tmp_path), 2, 2.0)
    with open(newest.path, "r+b") as f:
        f.truncate(os.path.getsize(newest.path) // 2)
    assert checkpoint.latest_good(str(tmp_path), "m", 0).path == first.path
    open(newest.path, "wb").close()  # zero bytes
    assert checkpoint.latest_good(str(tmp_path), "m", 0).path == first.path


def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    good = _save_tiny(str(tmp_path), 1, 1.0)
    # What a save killed at each point leaves: a half-written tmp file, then a renamed .ckpt whose
    # sidecar never landed, then a sidecar tmp that was never renamed.
    (tmp_path / f".{checkpoint.file_name('m', 0, 2, 5)}.tmp.ckpt").write_bytes(b"\x00" * 10)
    renamed = _save_tiny(str(tmp_path), 3, 3.0)
    os.replace(f"{renamed.path}.json", f"{renamed.path}.json.tmp")
    found = checkpoint.latest_good(str(tmp_path), "m", 0)
    assert found.path == good.path
    loaded = checkpoint.load(found.path, {"w": ((2, 3), "Float32")})
    assert np.all(loaded["params"]["w"].asnumpy() == 1.0)
    assert loaded["state"]["global_step"] == 5
    # The state lives inside the .ckpt itself: without its sidecar the file still says where it was.
    os.remove(f"{found.path}.json")
    assert checkpoint.load(found.path, {"w": ((2, 3), "Float32")})["state"] == {
        "epoch": 1, "step": 5, "global_step": 5, "config_hash": "h"}


def test_prune_keeps_the_newest_checkpoints_of_this_rank_only(tmp_path):
    saved = [_save_tiny(str(tmp_path), epoch, float(epoch)) for epoch in range(1, 5)]
    other_rank = _save_tiny(str(tmp_path), 1, 0.0, rank=1)
    checkpoint.prune(str(tmp_path), "m", 0, keep=2)
    assert [c.path for c in checkpoint.list_checkpoints(str(tmp_path), "m", 0)] == [saved[3].path, saved[2].path]
    for gone in saved[:2]:
        assert not os.path.exists(gone.path) and not os.path.exists(f"{gone.path}.json")
    assert os.path.exists(other_rank.path)
