"""engine/optim.py: the learning-rate schedules with warm-up."""
import numpy as np
import pytest

from msdist.engine import optim


def test_lr_schedules_with_warmup():
    const = optim.lr_schedule("constant", 0.1, epochs=2, steps_per_epoch=10, warmup_epochs=1)
    assert len(const) == 20 and const[0] == pytest.approx(0.01) and const[9] == pytest.approx(0.1)
    assert const[19] == pytest.approx(0.1)
    step = optim.lr_schedule("step", 0.1, epochs=6, steps_per_epoch=2, step_size=2, gamma=0.1)
    assert step[3] == pytest.approx(0.1) and step[4] == pytest.approx(0.01) and step[8] == pytest.approx(0.001)
    cos = optim.lr_schedule("cosine", 0.1, epochs=4, steps_per_epoch=5, min_lr=0.0)
    assert cos[0] == pytest.approx(0.1) and cos[-1] < 0.002 and np.all(np.diff(cos) <= 0)
