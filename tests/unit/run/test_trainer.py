"""The Trainer (msdist/run/trainer.py): one position type, the state it collects, and resume of checkpoints
written by earlier versions (tests/data/old_checkpoint, made by main at 355e633), in this process."""
import ast
import logging
import os

import numpy as np
import pytest

from conftest import OLD_OPTIONS, OLD_SINGLE, REPO, plan_on, tiny_args
from msdist.engine import optim
from msdist.run.position import Position


def test_position_counts_as_checkpoints_and_step_lines_do():
    assert Position.at(0, 12) == Position(0, 0, 0)
    assert Position.at(1, 12) == Position(1, 1, 1)
    assert Position.at(12, 12) == Position(1, 12, 12)   # the end of epoch 1, not the start of epoch 2
    assert Position.at(18, 12) == Position(2, 6, 18)
    assert Position(1, 12, 12).advanced(12) == Position(2, 1, 13)
    assert Position(1, 11, 11).advanced(12) == Position(1, 12, 12)
    assert Position().advanced(12) == Position(1, 1, 1)
    # The data plan and the LR schedule count from 0: the next step's epoch and the steps done in it.
    assert [(Position.at(g, 12).next_epoch(12), Position.at(g, 12).skip(12)) for g in (0, 6, 12, 18)] == \
        [(0, 0), (0, 6), (1, 0), (1, 6)]
    assert Position(1, 12, 12).epoch_complete(12) and not Position(2, 6, 18).epoch_complete(12)


def test_a_resume_with_other_steps_per_epoch_continues_at_the_global_step_and_says_so(caplog):
    logger = logging.getLogger("msdist.run.position")  # msdist's loggers may not propagate (logs.setup_logging)
    logger.addHandler(caplog.handler)
    try:
        assert Position(2, 6, 18).resumed(12, "x.ckpt") == Position(2, 6, 18)
        assert not caplog.records
        assert Position(2, 6, 18).resumed(8, "x.ckpt") == Position(3, 2, 18)
    finally:
        logger.removeHandler(caplog.handler)
    assert "x.ckpt was saved at epoch 2 step 6 (global step 18)" in caplog.text and "8 steps per epoch" in caplog.text


def test_no_epoch_arithmetic_outside_the_position_type():
    """`epoch + 1` and its kind live in run/position.py only."""
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "msdist")):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path.endswith(os.path.join("run", "position.py")):
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
                    names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in (node.left,)}
                    if any("epoch" in n for n in names) and isinstance(node.right, ast.Constant):
                        found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not found


# ---------------------------------------------------------------- what a checkpoint holds

def test_each_state_prefix_is_written_once_in_the_package():
    from msdist.engine import ema, loss_scale, reducers
    prefixes = optim.STATE_PREFIXES + (reducers.RESIDUAL_PREFIX, loss_scale.STATE_PREFIX, ema.PREFIX)
    from msdist.run import checkpoint_model
    assert checkpoint_model.training_state_prefixes() == prefixes
    seen = {p: [] for p in prefixes if p.endswith(".")}
    for root, _, files in os.walk(os.path.join(REPO, "msdist")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Constant) and node.value in seen:
                    seen[node.value].append(os.path.relpath(path, REPO))
    assert all(len(where) == 1 for where in seen.values()), seen


def _trainer(tmp_path, data_dir, *extra):
    """A Trainer built in this process as msdist.train builds it (one rank, CPU)."""
    import mindspore as ms
    from msdist.rank import distributed, runtime
    from msdist.run import build, config
    from msdist.run.trainer import Trainer
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    run = plan_on(config.parse(tiny_args(data_dir, tmp_path, *extra)), 1, "CPU")
    dist, collectives = distributed.DistInfo(0, 1, 0, "CPU", ""), distributed.Collectives(1)
    rt = runtime.RuntimeInfo("default", "env", 1)
    build.seed_everything(run.seed)
    data = build.load_data(run, dist, collectives, rt)
    return Trainer(run, dist, collectives, data, build.build_model(run, dist, data, rt), beat=None,
                   launch_kind="standalone")


def test_the_trainers_state_is_exactly_what_the_components_declare(tmp_path, data_dir):
    from msdist.engine import ema, loss_scale, reducers
    from msdist.run.trainer import state_parameters
    model = _trainer(tmp_path, data_dir, "--loss_scale", "dynamic", "--ema_decay", 0.9).model
    declared = {optim.STATE_PREFIXES: optim.state_parameters(model.optimizer),
                (reducers.RESIDUAL_PREFIX,): reducers.state_parameters(model.reducer),
                (loss_scale.STATE_PREFIX,): model.scaler.state_parameters(),
                (ema.PREFIX,): model.ema.state_parameters()}
    state = state_parameters(model)
    assert [p.name for p in state] == [p.name for params in declared.values() for p in params]
    assert len({p.name for p in state}) == len(state) == 38 + 1 + 0 + 3 + 62
    for prefixes, params in declared.items():  # each under its own component's prefix
        assert all(p.name.startswith(prefixes) for p in params), prefixes


@pytest.mark.slow
def test_an_epoch_end_makes_the_ranks_one_model_once_and_its_best_is_the_file_just_saved(tmp_path, data_dir):
    """Save and evaluate at one epoch end share one `_one_model` (the EMA synced once, the BatchNorm statistics
    gathered once), and the best checkpoint is decided by position: a link to the file saved at that step."""
    from msdist.cluster.stall import StallPolicy
    from msdist.rank import heartbeat_writer
    from msdist.run import checkpoint
    trainer = _trainer(tmp_path, data_dir, "--ema_decay", 0.9, "--epochs", 1)
    os.makedirs(tmp_path / "logs", exist_ok=True)
    trainer.beat = heartbeat_writer.Heartbeat(str(tmp_path / "logs"), 0,
                                              StallPolicy.from_options({"stall_timeout": "0"}))
    ema, syncs = trainer.model.ema, []
    synchronize = ema.synchronize
    ema.synchronize = lambda collectives: syncs.append(collectives) or synchronize(collectives)
    outcome = trainer.fit()
    assert len(syncs) == 1 and outcome.metrics["accuracy"] >= 0
    best = checkpoint.best_path(trainer.run.checkpoints.directory, trainer.run.checkpoints.prefix, 0)
    assert outcome.newest.position == outcome.position and os.path.samefile(best, outcome.newest.path)


# ---------------------------------------------------------------- checkpoints of earlier versions resume

def test_an_old_checkpoint_restores_position_weights_and_training_state(tmp_path, data_dir):
    import mindspore as ms
    trainer = _trainer(tmp_path, data_dir, *OLD_OPTIONS, "--resume", OLD_SINGLE)
    at = trainer.resume()
    assert at == Position(2, 6, 18) and (at.next_epoch(12), at.skip(12)) == (1, 6)
    saved = {n: v for n, v in ms.load_checkpoint(OLD_SINGLE).items() if hasattr(v, "asnumpy")
             and not n.startswith("msdist_state.")}
    restored = trainer.saver.params  # model, moments, global_step, loss scale, EMA
    assert {p.name for p in restored} == set(saved)
    for param in restored:
        np.testing.assert_array_equal(param.asnumpy(), saved[param.name].asnumpy(), err_msg=param.name)


def test_the_stop_check_after_a_step_has_a_phase_of_its_own(tmp_path):
    """The preemption check after a step is a collective (preempt_stop.Agreement): a rank held there by a stuck one
    must say so in the stall line, not look like a rank waiting for its data."""
    from types import SimpleNamespace
    from msdist.cluster.stall import StallPolicy
    from msdist.rank import heartbeat_writer
    from msdist.run.trainer import Trainer
    beat = heartbeat_writer.Heartbeat(str(tmp_path), 0, StallPolicy.from_options({}))
    beat.step_done(1, 12, 12)
    beat.enter("data wait")
    during = []
    stop = SimpleNamespace(stop_at=lambda step: during.append((step, beat.snapshot()["phase"])) or False,
                           faulted=None)
    assert Trainer._stop_agreed(SimpleNamespace(beat=beat, stop=stop), Position(1, 12, 12)) is False
    assert during == [(12, "stop check")]
    assert beat.snapshot()["phase"] == "data wait"   # then the loop waits for the next batch


@pytest.mark.slow
def test_the_boundary_work_happens_at_chunk_ends(tmp_path, data_dir):
    """--sink_size 8: the heartbeat, the saves by steps and the stop check come after each chunk
    (run/chunks.py), not after each step; the chunks end at the log steps, the saves, the epoch's end and max_steps."""
    from msdist.cluster.stall import StallPolicy
    from msdist.rank import heartbeat_writer, preempt_stop
    trainer = _trainer(tmp_path, data_dir, "--sink_size", 8, "--epochs", 2, "--max_steps", 20, "--log_every", 10,
                       "--save_every_steps", 9)
    os.makedirs(tmp_path / "logs", exist_ok=True)
    beat = heartbeat_writer.Heartbeat(str(tmp_path / "logs"), 0, StallPolicy.from_options({"stall_timeout": "0"}))
    beats, checks, saves = [], [], []
    step_done = beat.step_done
    beat.step_done = lambda epoch, step, global_step: beats.append(global_step) or step_done(epoch, step, global_step)
    trainer.beat = beat
    agreement = preempt_stop.Agreement
    stop_at = agreement.stop_at
    agreement.stop_at = lambda self, step: checks.append(step) or stop_at(self, step)
    save = trainer.background.save
    trainer.background.save = lambda at: saves.append(at.global_step) or save(at)
    try:
        trainer.fit()
    finally:
        agreement.stop_at = stop_at
    ends = [8, 9, 10, 12, 18, 20]   # 8 = K; 9, 18 saves by steps; 10 a log step; 12 the epoch's end; 20 max_steps
    assert beats == ends and checks == [e for e in ends if e != 20] and saves == [9, 18]
