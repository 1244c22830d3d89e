"""msdist/launch.py: the command line parsed once into a frozen plan whose fields are named."""
import dataclasses
import os
import signal

import pytest

from msdist import launch
from msdist.base.errors import ConfigError
from msdist.cluster.stall import StallPolicy
from msdist.launcher import elastic
from msdist.launcher.supervisor import Plan
from msdist.run import config
from conftest import REAL_DATA as DATA_DIR


def test_main_parses_the_train_config_once_and_runs_the_plan_it_named(tmp_path, monkeypatch):
    parsed, ran = [], []
    real_parse = config.parse
    monkeypatch.setattr(config, "parse", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    monkeypatch.setattr(launch, "run", lambda plan, *supervisor: ran.append(plan) or 0)  # start no rank
    out = str(tmp_path / "x")
    train_args = ["--data_dir", DATA_DIR, "--output_dir", out, "--stall_timeout", "30", "--preempt_signal", "USR2"]
    assert launch.main(["-n", "2", "--max_restarts", "1", *train_args]) == 0
    assert len(parsed) == 1   # the option checks and this node's path checks share one parse
    policy = StallPolicy.from_options(vars(real_parse(train_args)))
    assert ran == [Plan(nproc=2, nnodes=1, max_nodes=1, node_rank=0, master_addr="127.0.0.1", master_port=0,
                        wait_for_nodes=30.0, max_restarts=1, stall=policy, preempt_signal=signal.SIGUSR2,
                        train_args=train_args, output_dir=os.path.abspath(out))]


def test_the_command_is_frozen_and_keeps_the_plan_options_out_of_the_supervisors_plan():
    command = launch.read_command(["-n", "1", "--plan", "--host_root", "/tmp", "--data_dir", DATA_DIR])
    assert (command.show_plan, command.host_root, command.train.data_dir) == (True, "/tmp", DATA_DIR)
    with pytest.raises(dataclasses.FrozenInstanceError):
        command.plan.nproc = 2
    assert {"show_plan", "host_root", "data_dir"}.isdisjoint(f.name for f in dataclasses.fields(Plan))


def test_the_elastic_membership_options_have_documented_defaults_and_are_checked():
    assert launch.read_command(["-n", "1", "--data_dir", DATA_DIR]).limits == elastic.Limits(10.0, 3)
    limits = launch.read_command(["-n", "1", "--membership_timeout", "30", "--max_reforms", "0", "--data_dir",
                                  DATA_DIR]).limits
    assert limits == elastic.Limits(membership_timeout=30.0, max_reforms=0)
    for option, value, named in [("--membership_timeout", "1", "--membership_timeout 1 must be >= 2 s"),
                                 ("--max_reforms", "-1", "--max_reforms -1 must be >= 0")]:
        with pytest.raises(ConfigError, match=named):
            launch.read_command(["-n", "1", option, value, "--data_dir", DATA_DIR])
