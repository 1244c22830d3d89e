"""msdist/train.py in this process: an output folder that holds another run is refused, or moved aside (never
deleted). Whole training runs are integration tests (tests/integration/test_train.py)."""
import json
import os

import pytest

from msdist.base.errors import ConfigError


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
