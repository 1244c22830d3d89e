"""engine/ema.py: the EMA update, swap and resume."""
import numpy as np

from msdist.run.position import Position


def test_ema_update_swap_and_resume(tmp_path):
    import mindspore as ms
    from mindspore import nn
    from msdist.engine import ema
    from msdist.rank import distributed
    from msdist.run import checkpoint_saver
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = nn.Dense(3, 2)
    start = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    averaged = ema.create(net, 0.75)
    assert ema.create(net, 0.0) is None
    for param in net.get_parameters():
        param.set_data(ms.Tensor(np.full(param.shape, 2.0, np.float32)))
    averaged()
    for weight, average in zip(net.get_parameters(), averaged.state_parameters()):
        assert average.name == "ema." + weight.name
        np.testing.assert_allclose(average.asnumpy(), 0.75 * start[weight.name] + 0.25 * 2.0, rtol=1e-6)
    expected = {a.name: a.asnumpy().copy() for a in averaged.state_parameters()}
    with averaged.swapped_into():  # evaluation sees the EMA, training gets its own weights back
        assert all(np.array_equal(w.asnumpy(), expected["ema." + w.name]) for w in net.get_parameters())
    assert all((w.asnumpy() == 2.0).all() for w in net.get_parameters())
    assert [e["name"] for e in averaged.as_model_checkpoint()] == [p.name for p in net.get_parameters()]

    # Saved with the resumable state, restored by the same resume that restores the weights.
    def saver(model, average):
        return checkpoint_saver.Saver(directory=str(tmp_path), prefix="m", rank=0, keep=2, config_hash="h", net=model,
                                train_state=average.state_parameters(), collectives=distributed.Collectives(1))
    info = saver(net, averaged).save(Position(1, 2, 2))
    other = nn.Dense(3, 2)  # the same parameter names as `net`
    fresh = ema.create(other, 0.75)
    assert saver(other, fresh).resume(info.path).position == Position(1, 2, 2)
    for average in fresh.state_parameters():
        np.testing.assert_array_equal(average.asnumpy(), expected[average.name])
