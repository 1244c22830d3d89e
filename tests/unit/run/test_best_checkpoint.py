"""The best checkpoint (run/best_checkpoint.py, with the Saver of run/checkpoint_saver.py): it survives pruning,
holds the best epoch, is the file just saved at that position, and is not hashed again at every evaluation."""
import os

import numpy as np


def _params(epoch):
    import mindspore as ms
    return [{"name": "w", "data": ms.Parameter(ms.Tensor(np.full((2, 3), epoch, np.float32)), name="w")}]


def _state(epoch):
    return {"epoch": epoch, "step": 5, "global_step": epoch * 5, "config_hash": "h"}


def _save(directory, best, epoch, accuracy=None):
    """One tiny checkpoint at `epoch`; with `accuracy`, offered as the best too."""
    from msdist.run import checkpoint
    checkpoint.save(_params(epoch), directory, "m", 0, _state(epoch))
    checkpoint.prune(directory, "m", 0, keep=1)
    if accuracy is not None:
        best.offer(_params(epoch), _state(epoch), accuracy)


def test_best_checkpoint_survives_pruning_and_holds_the_best_epoch(tmp_path):
    from msdist.run import checkpoint
    from msdist.run.best_checkpoint import Best
    directory = str(tmp_path)
    keeper = Best(directory, "m", 0)
    for epoch, accuracy in ((1, 0.5), (2, 0.8), (3, 0.6), (4, 0.8), (5, None)):
        _save(directory, keeper, epoch, accuracy)
    assert sorted(os.listdir(directory)) == ["m_rank0-5_5.ckpt", "m_rank0-5_5.ckpt.json",
                                             "m_rank0_best.ckpt", "m_rank0_best.ckpt.json"]
    best = Best(directory, "m", 0).read()  # as a new process (a resumed run) reads it: verified in full
    assert (best["epoch"], best["accuracy"]) == (2, 0.8)  # a tie later does not replace it
    path = checkpoint.best_path(directory, "m", 0)
    assert checkpoint.verify(path) is None and best["sha256"] == checkpoint.sha256_file(path)
    loaded = checkpoint.load(path, {"w": ((2, 3), "Float32")})
    assert (loaded["params"]["w"].asnumpy() == 2).all() and loaded["state"]["epoch"] == 2
    assert checkpoint.latest_good(directory, "m", 0).position.epoch == 5  # resume never picks the best file
    with open(path, "r+b") as f:  # a corrupt best is not trusted: the next evaluation replaces it
        f.write(b"\0" * 16)
    resumed = Best(directory, "m", 0)
    assert resumed.read() is None
    assert resumed.offer(_params(6), _state(6), 0.1) and Best(directory, "m", 0).read()["epoch"] == 6


def test_the_best_is_hashed_once_not_at_every_evaluation(tmp_path, monkeypatch):
    """The process that wrote the best trusts it as written; a reader hashes it once, and again only when the file
    changed (here: cut short). Loading it still checks the sha256 in full."""
    import pytest
    from msdist.base.errors import CheckpointError
    from msdist.run import checkpoint
    from msdist.run.best_checkpoint import Best
    directory = str(tmp_path)
    keeper = Best(directory, "m", 0)
    hashed = []
    real_sha256 = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path) or real_sha256(path))
    assert keeper.offer(_params(1), _state(1), 0.5)
    written = len(hashed)  # the write computes the sidecar's sha256
    for _ in range(5):  # five more evaluations, none better
        assert not keeper.offer(_params(2), _state(2), 0.4)
    assert len(hashed) == written
    reader = Best(directory, "m", 0)
    for _ in range(3):
        assert reader.read()["accuracy"] == 0.5
    assert len(hashed) == written + 1
    with open(keeper.path, "r+b") as f:
        f.truncate(os.path.getsize(keeper.path) - 8)
    assert keeper.read() is None and reader.read() is None
    with pytest.raises(CheckpointError, match="failed its integrity check"):
        checkpoint.load(keeper.path, {"w": ((2, 3), "Float32")})


def test_best_right_after_a_save_at_the_same_position_is_that_checkpoint(tmp_path):
    """The usual end of an epoch (save, then evaluate at the same position): the best is a hard link to the
    numbered checkpoint, so the model is on disk once, decided by position without hashing the weights; a model
    evaluated at a position with no save of its own (trained on since) gets its own file."""
    import mindspore as ms
    from msdist.rank.distributed import Collectives
    from msdist.run import checkpoint, checkpoint_model, checkpoint_saver
    from msdist.run.best_checkpoint import Best
    from msdist.run.position import Position
    net = ms.nn.Dense(3, 2)
    moments = ms.Parameter(ms.Tensor(np.ones((2, 3), np.float32)), name="moments.weight")
    saver = checkpoint_saver.Saver(directory=str(tmp_path), prefix="m", rank=0, keep=2, config_hash="h", net=net,
                                   train_state=[moments], collectives=Collectives(1))
    at = Position(1, 4, 4)
    numbered = saver.save(at).path
    assert saver.keep_best(at, accuracy=0.5)
    best = checkpoint.best_path(str(tmp_path), "m", 0)
    assert os.path.samefile(best, numbered) and Best(str(tmp_path), "m", 0).read()["accuracy"] == 0.5
    checkpoint_model.load_weights(best, net)   # evaluation reads the model part and ignores the training state
    assert saver.keep_best(at, accuracy=0.55)   # already that file: nothing left behind
    assert os.path.samefile(best, numbered) and not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    net.weight.set_data(ms.Tensor(np.zeros((2, 3), np.float32)))   # trained on to the next epoch, not saved there
    assert saver.keep_best(Position(2, 4, 8), accuracy=0.6)
    assert not os.path.samefile(best, numbered) and Best(str(tmp_path), "m", 0).read()["accuracy"] == 0.6
    tensors = checkpoint.read_tensors(best)
    assert set(tensors) == {"weight", "bias"} | {f"msdist_state.{k}" for k in checkpoint.STATE_KEYS}
    assert (tensors["weight"].asnumpy() == 0).all()   # the model as evaluated
