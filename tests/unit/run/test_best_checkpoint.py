"""The best checkpoint (run/checkpoint.py, run/checkpoint_saver.py): it survives pruning, holds the best
epoch, and is the file just saved at that position."""
import os

import numpy as np



def _save(directory, epoch, accuracy=None):
    """One tiny checkpoint at `epoch`; with `accuracy`, offered as the best too."""
    import mindspore as ms
    from msdist.run import checkpoint
    params = [{"name": "w", "data": ms.Parameter(ms.Tensor(np.full((2, 3), epoch, np.float32)), name="w")}]
    state = {"epoch": epoch, "step": 5, "global_step": epoch * 5, "config_hash": "h"}
    checkpoint.save(params, directory, "m", 0, state)
    checkpoint.prune(directory, "m", 0, keep=1)
    if accuracy is not None:
        checkpoint.keep_best(params, directory, "m", 0, state, accuracy)


def test_best_checkpoint_survives_pruning_and_holds_the_best_epoch(tmp_path):
    from msdist.run import checkpoint
    directory = str(tmp_path)
    for epoch, accuracy in ((1, 0.5), (2, 0.8), (3, 0.6), (4, 0.8), (5, None)):
        _save(directory, epoch, accuracy)
    assert sorted(os.listdir(directory)) == ["m_rank0-5_5.ckpt", "m_rank0-5_5.ckpt.json",
                                             "m_rank0_best.ckpt", "m_rank0_best.ckpt.json"]
    best = checkpoint.read_best(directory, "m", 0)
    assert (best["epoch"], best["accuracy"]) == (2, 0.8)  # a tie later does not replace it
    path = checkpoint.best_path(directory, "m", 0)
    assert checkpoint.verify(path) is None and best["sha256"] == checkpoint.sha256_file(path)
    loaded = checkpoint.load(path, {"w": ((2, 3), "Float32")})
    assert (loaded["params"]["w"].asnumpy() == 2).all() and loaded["state"]["epoch"] == 2
    assert checkpoint.latest_good(directory, "m", 0).position.epoch == 5  # resume never picks the best file
    with open(path, "r+b") as f:  # a corrupt best is not trusted: the next evaluation replaces it
        f.write(b"\0" * 16)
    assert checkpoint.read_best(directory, "m", 0) is None


def test_best_right_after_a_save_at_the_same_position_is_that_checkpoint(tmp_path):
    """The usual end of an epoch (save, then evaluate at the same position): the best is a hard link to the
    numbered checkpoint, so the model is on disk once, decided by position without hashing the weights; a model
    evaluated at a position with no save of its own (trained on since) gets its own file."""
    import mindspore as ms
    from msdist.rank.distributed import Collectives
    from msdist.run import checkpoint, checkpoint_model, checkpoint_saver
    from msdist.run.position import Position
    net = ms.nn.Dense(3, 2)
    moments = ms.Parameter(ms.Tensor(np.ones((2, 3), np.float32)), name="moments.weight")
    saver = checkpoint_saver.Saver(directory=str(tmp_path), prefix="m", rank=0, keep=2, config_hash="h", net=net,
                                   train_state=[moments], collectives=Collectives(1))
    at = Position(1, 4, 4)
    numbered = saver.save(at).path
    assert saver.keep_best(at, accuracy=0.5)
    best = checkpoint.best_path(str(tmp_path), "m", 0)
    assert os.path.samefile(best, numbered) and checkpoint.read_best(str(tmp_path), "m", 0)["accuracy"] == 0.5
    checkpoint_model.load_weights(best, net)   # evaluation reads the model part and ignores the training state
    assert saver.keep_best(at, accuracy=0.55)   # already that file: nothing left behind
    assert os.path.samefile(best, numbered) and not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    net.weight.set_data(ms.Tensor(np.zeros((2, 3), np.float32)))   # trained on to the next epoch, not saved there
    assert saver.keep_best(Position(2, 4, 8), accuracy=0.6)
    assert not os.path.samefile(best, numbered) and checkpoint.read_best(str(tmp_path), "m", 0)["accuracy"] == 0.6
    tensors = checkpoint.read_tensors(best)
    assert set(tensors) == {"weight", "bias"} | {f"msdist_state.{k}" for k in checkpoint.STATE_KEYS}
    assert (tensors["weight"].asnumpy() == 0).all()   # the model as evaluated
