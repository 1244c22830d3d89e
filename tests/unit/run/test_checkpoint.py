"""run/checkpoint.py: a corrupt newest checkpoint falls back to the previous one, a kill during save leaves
the previous one loadable, pruning keeps this rank's newest; checkpoints from elsewhere are refused before
reading (pickle, over the size cap) or named parameter by parameter where they do not fit."""
import os
import pickle

import numpy as np
import pytest

from msdist.base.errors import CheckpointError
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


def test_foreign_checkpoint_files_are_refused_before_reading(tmp_path):
    from msdist.run import checkpoint

    expected = {"fc.weight": ((2, 4), "Float32")}
    pt = tmp_path / "model.pt"
    pt.write_bytes(pickle.dumps({"fc.weight": [1, 2]}))
    with pytest.raises(CheckpointError, match="never pickle"):
        checkpoint.load(str(pt), expected)
    pickled = tmp_path / "pickled.ckpt"
    pickled.write_bytes(pickle.dumps({"fc.weight": [1, 2]}))
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(str(pickled), expected)
    huge = tmp_path / "huge.ckpt"
    with open(huge, "wb") as f:
        f.truncate(checkpoint.MAX_CHECKPOINT_BYTES + 1)    # sparse: no disk used
    with pytest.raises(CheckpointError, match="over the .* cap"):
        checkpoint.load(str(huge), expected)


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_checkpoint_names_every_parameter_that_does_not_fit(tmp_path, fmt):
    import mindspore as ms
    from msdist.run import checkpoint

    path = str(tmp_path / f"model.{fmt}")
    ms.save_checkpoint([{"name": "fc.weight", "data": ms.Tensor(np.ones((2, 4), np.float16))},
                        {"name": "fc.bias", "data": ms.Tensor(np.zeros((2,), np.float32))},
                        {"name": "old.head", "data": ms.Tensor(np.zeros((3,), np.float32))}], path, format=fmt)
    fits = {"fc.weight": ((2, 4), "Float16"), "fc.bias": ((2,), "Float32"), "old.head": ((3,), "Float32")}
    loaded = checkpoint.load(path, fits)["params"]
    assert sorted(loaded) == sorted(fits) and loaded["fc.weight"].asnumpy().sum() == 8
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, {"fc.weight": ((2, 4), "Float32"), "fc.bias": ((2,), "Float32"),
                               "conv.weight": ((1,), "Float32")})
    message = str(err.value)
    assert "missing 1 parameter(s): conv.weight" in message and "unexpected 1 parameter(s): old.head" in message
    assert "fc.weight is Float16[2, 4], model needs Float32[2, 4]" in message
