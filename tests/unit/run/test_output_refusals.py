"""Output folders and checkpoints that are not this run's: refused, moved aside (never deleted), or named
parameter by parameter."""
import json
import os
import pickle

import numpy as np
import pytest

from msdist.base.errors import CheckpointError, ConfigError


def test_output_dir_with_checkpoints_is_refused_then_moved_aside_never_deleted(tmp_path):
    from msdist.train import _claim_output_dir

    out = tmp_path / "out"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").write_bytes(b"old weights")
    (out / "result.json").write_text('{"accuracy": 0.9}')
    (out / "logs").mkdir()
    (out / "compile_cache").mkdir()
    with pytest.raises(ConfigError, match="--resume auto.*--overwrite true"):
        _claim_output_dir(str(out), "", False, True)
    assert _claim_output_dir(str(out), "auto", False, True) is None        # resuming is fine
    assert _claim_output_dir(str(out), "", True, False) is None            # other ranks move nothing
    assert (out / "ckpt" / "resnet_tiny_rank0-1_2.ckpt").exists()
    archive = _claim_output_dir(str(out), "", True, True)
    assert os.path.basename(archive).startswith("replaced-")
    assert open(os.path.join(archive, "ckpt", "resnet_tiny_rank0-1_2.ckpt"), "rb").read() == b"old weights"
    assert json.load(open(os.path.join(archive, "result.json"))) == {"accuracy": 0.9}
    assert sorted(os.listdir(out)) == sorted(["compile_cache", "logs", os.path.basename(archive)])
    assert _claim_output_dir(str(out), "", False, True) is None            # now free for a new run


# ---------------------------------------------------------------- checkpoints from elsewhere, in-process

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
