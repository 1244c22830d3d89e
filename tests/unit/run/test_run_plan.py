"""run/run_plan.py: the options resolved once, at start-up, into one frozen plan; nothing after start-up reads them.

The rule, checked on each module's syntax tree (`ast`, so comments and strings never count), for every module of
msdist/ but the config and plan code (`START_UP`) and the faces that parse a command line of their own (`FACES`):
  1. no parameter (of a function, method or lambda) named `cfg` or `config`, or annotated `argparse.Namespace`;
  2. no variable or attribute named `cfg` (the namespace `config.parse` returns, `startup.Started.cfg`);
  3. no call of `config.parse`.
And outside base/launch_env.py (who this process is), the start-up and cluster/ (how the ranks meet: the launchers'
variables, which decide no training), no module reads `os.environ` or `os.getenv`: what the environment says about
training (`MSDIST_BATCH_SLOTS`, `MSDIST_RESUME_FROM_RANK0`) is in the plan.
"""
import ast
import dataclasses
import os

import pytest

import msdist
from conftest import plan_on
from msdist.base import launch_env
from msdist.rank import device, distributed
from msdist.run import config, run_plan

PACKAGE = os.path.dirname(msdist.__file__)
NAMESPACE_NAMES = {"cfg", "config"}
# The config and plan code: where the namespace is made, checked and resolved, once per process.
START_UP = {"run/config.py", "run/options.py", "run/run_plan.py", "run/startup.py"}
# Faces whose whole work is a start-up: `msdist.check --plan` prints the plan training would resolve; plan_scale
# forecasts from options of its own; msdist.launch checks the training options once before any rank starts;
# check's --gpu_bench plans the device as training would, to choose its runs, and starts them.
FACES = {"check.py", "plan_scale.py", "launch.py", "gpu_bench.py"}
# Where the environment may be read: who this process is, and how the ranks of a job meet (base/cli.py labels a
# crash with its rank).
ENVIRONMENT_READERS = ("base/", "cluster/", "launcher/", "rank/")


def _namespace_annotation(node) -> bool:
    return node is not None and ast.unparse(node) in ("argparse.Namespace", "Namespace")


def config_reads(source: str) -> list:
    """(line, what) for every place `source` reads the config namespace (rules 1-3 of this module's docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and (node.arg in NAMESPACE_NAMES or _namespace_annotation(node.annotation)):
            found.append((node.lineno, f"parameter {node.arg!r}"))
        elif isinstance(node, ast.Name) and node.id == "cfg" or isinstance(node, ast.Attribute) and node.attr == "cfg":
            found.append((node.lineno, "the namespace 'cfg'"))
        elif isinstance(node, ast.Attribute) and node.attr == "parse" and ast.unparse(node.value) == "config":
            found.append((node.lineno, "config.parse"))
    return found


def environment_reads(source: str) -> list:
    """(line, what) for every `os.environ` / `os.getenv` in `source`."""
    return [(node.lineno, f"os.{node.attr}") for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            and ast.unparse(node.value) == "os"]


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(root, name), PACKAGE).replace(os.sep, "/")


def _source(module: str) -> str:
    with open(os.path.join(PACKAGE, module), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("module", sorted(set(_modules()) - START_UP - FACES))
def test_no_module_after_start_up_reads_the_config(module):
    found = config_reads(_source(module))
    assert not found, f"msdist/{module} reads the config namespace: " + \
        ", ".join(f"line {line}: {what}" for line, what in found) + \
        "; give the value a field in msdist/run/run_plan.py (resolved once at start-up) and pass the plan"


@pytest.mark.parametrize("module", sorted(m for m in set(_modules()) - START_UP - FACES
                                          if not m.startswith(ENVIRONMENT_READERS)))
def test_no_module_decides_training_from_the_environment(module):
    found = environment_reads(_source(module))
    assert not found, f"msdist/{module} reads the environment: " + \
        ", ".join(f"line {line}: {what}" for line, what in found) + "; resolve it into the run plan at start-up"


@pytest.mark.parametrize("source", [
    "def f(cfg):\n    return cfg.lr",
    "def f(*, config=None):\n    pass",
    "g = lambda cfg: 1",
    "def f(ns: argparse.Namespace):\n    return ns.lr",
    "def f(started):\n    return started.cfg.lr",
    "cfg = parse()",
    "values = config.parse(argv)",
])
def test_the_check_finds_each_way_in(source):
    assert config_reads(source), source


def test_the_check_passes_the_plan_and_the_schema():
    source = ("def train(started):\n    run = started.plan\n    return run.schedule.epochs\n"
              "opts = config.EVAL_OPTIONS\n")
    assert config_reads(source) == []
    assert environment_reads("os.environ.get('X')\nos.getenv('Y')") and environment_reads("env = dict(x)") == []


def _frozen_all_the_way(value, path="plan") -> list:
    """The parts of `value` that could change after start-up: a dataclass not frozen, a list, a dict, a set."""
    if dataclasses.is_dataclass(value):
        own = [] if value.__dataclass_params__.frozen else [path]
        return own + [p for f in dataclasses.fields(value)
                      for p in _frozen_all_the_way(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, (list, dict, set)):
        return [path]
    if isinstance(value, tuple):
        return [p for i, v in enumerate(value) if not isinstance(v, (list, dict))  # settings' values: config.yaml's
                for p in _frozen_all_the_way(v, f"{path}[{i}]")]
    return []


def test_the_plan_is_frozen_all_the_way_down(tmp_path):
    run = plan_on(config.parse(["--output_dir", str(tmp_path)]), 2, "CPU")
    assert _frozen_all_the_way(run) == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.schedule.epochs = 3   # type: ignore[misc]


def test_the_plan_holds_what_training_reads_resolved(tmp_path):
    cfg = config.parse(["--output_dir", str(tmp_path), "--batch_size", "32", "--grad_accum_steps", "2", "--lr", "0.1",
                        "--scale_lr", "true", "--ckpt_prefix", "", "--model", "resnet18", "--keep_checkpoint_max", "3",
                        "--resume", "auto", "--save_every_steps", "7", "--preempt_signal", "USR2"])
    run = plan_on(cfg, 2, "GPU", {launch_env.BATCH_SLOTS_VAR: "4", launch_env.RESUME_FROM_RANK0_VAR: "1"})
    assert (run.batch.slots, run.batch.micro_batch, run.batch.eval_batch) == (4, 4, 8)
    assert run.schedule.lr.base_lr == pytest.approx(0.4) and run.schedule.save_every_steps == 7
    assert (run.step.amp_level, run.step.accum_steps) == ("O2", 2)   # `auto` resolved for the decided device
    assert run.checkpoints == run_plan.CheckpointPlace(str(tmp_path / "ckpt"), "resnet18", 3, config.config_hash(cfg))
    assert run.resume == run_plan.ResumeRule("auto", True)
    assert run.preempt_signal.name == "SIGUSR2" and run.output.logs == str(tmp_path / "logs")
    assert dict(run.settings)["batch_size"] == 32
    assert run.schedule.sink_size == 1   # a rank owning 2 slots: BatchNorm statistics swapped from the host


def test_accumulation_alone_is_sunk_on_gpu_and_several_slots_are_not(tmp_path):
    cfg = config.parse(["--output_dir", str(tmp_path), "--batch_size", "32", "--grad_accum_steps", "2"])
    assert plan_on(cfg, 2, "GPU").schedule.sink_size == 10      # `auto`: the largest K dividing --log_every 10
    assert plan_on(cfg, 2, "CPU").schedule.sink_size == 1       # no data sink on CPU
    assert plan_on(cfg, 2, "GPU", {launch_env.BATCH_SLOTS_VAR: "4"}).schedule.sink_size == 1


def test_the_settings_write_the_config_yaml_the_options_read_back(tmp_path):
    cfg = config.parse(["--output_dir", str(tmp_path), "--lr", "0.3", "--epochs", "4"])
    run_plan.write_settings(plan_on(cfg, 1, "CPU"), str(tmp_path / "config.yaml"))
    read_back = vars(config.parse(["--config", str(tmp_path / "config.yaml")]))
    given = vars(cfg)
    assert {k: v for k, v in read_back.items() if k != "config"} == {k: v for k, v in given.items() if k != "config"}


def test_the_join_verifies_start_up_s_device_and_decides_nothing_again(monkeypatch):
    """A CPU decided at start-up stays a CPU, whatever the host now says (no second host probe)."""
    monkeypatch.setattr(device, "host_probe", lambda *a, **k: pytest.fail("the device was planned again"))
    planned = device.DevicePlan("auto", "CPU", "auto: no NVIDIA hardware on this host")
    assert distributed.verify_device(planned, launch_env.detect_launch({})) is planned


def test_check_plan_reads_the_resumed_checkpoint_once_as_training_does(monkeypatch, tmp_path, capsys):
    """`msdist.check --plan --resume F` resolves the batch in its plan only: one read of F's recorded layout."""
    from msdist import check
    from msdist.run import options
    reads = []
    monkeypatch.setattr(options, "resumed_slots", lambda cfg, world_size: reads.append(cfg.resume) or None)
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MS_ROLE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert check.plan_main(["--output_dir", str(tmp_path), "--resume", str(tmp_path / "a.ckpt"),
                            "--device_target", "CPU", "--num_classes", "4"]) == 0
    assert reads == [str(tmp_path / "a.ckpt")]
    assert "[rank 0] device: CPU" in capsys.readouterr().out


def test_gpu_auto_carries_this_hosts_forecast_of_a_sunk_step_for_the_agreement(tmp_path):
    from msdist.rank import device
    cfg = config.parse(["--output_dir", str(tmp_path), "--batch_size", "64", "--model", "resnet50",
                        "--image_size", "100"])

    def forecast(target, gpu_name, argv=(), environ=None):
        plan = run_plan.resolve(config.parse(["--output_dir", str(tmp_path), "--batch_size", "64", "--model",
                                              "resnet50", "--image_size", "100", *argv]), 2,
                                device.DevicePlan(target, target, "test", 0), environ or {}, gpu_name=gpu_name)
        return plan.schedule.sunk_step_s
    # 32 images a rank at 2470 img/s (A100, AMP, 224 px) scaled by (100/224)^2, plus MindSpore's 0.095 ms a step.
    assert forecast("GPU", "NVIDIA A100-SXM4-40GB") == pytest.approx((32 * 1000 / 2470 * (100 / 224) ** 2 + 0.095)
                                                                     / 1000)
    assert forecast("GPU", "NVIDIA GeForce RTX 3090") == 0.0        # no figures: agreed from the options' K
    assert forecast("GPU", "NVIDIA A100-SXM4-40GB", ["--sink_size", "8"]) is None
    assert forecast("GPU", "NVIDIA A100-SXM4-40GB", environ={launch_env.BATCH_SLOTS_VAR: "4"}) is None
    assert forecast("CPU", "") is None
    assert plan_on(cfg, 2, "CPU").schedule.sunk_step_s is None


def test_start_up_agrees_k_and_the_step_line_and_leaves_other_plans_alone(tmp_path):
    from msdist.rank import device, distributed
    from msdist.run import startup
    argv = ["--output_dir", str(tmp_path), "--batch_size", "32", "--model", "resnet50", "--image_size", "100"]
    gpu = run_plan.resolve(config.parse(argv), 1, device.DevicePlan("GPU", "GPU", "test", 0), {},
                           gpu_name="NVIDIA A100-SXM4-40GB")
    agreed = startup.agree_sink_size(gpu, distributed.Collectives(1))
    assert (agreed.schedule.sink_size, agreed.schedule.log_every, agreed.schedule.sunk_step_s) == (187, 187, None)
    assert agreed.schedule.epochs == gpu.schedule.epochs and agreed.batch == gpu.batch
    cpu = plan_on(config.parse(argv), 1, "CPU")
    assert startup.agree_sink_size(cpu, distributed.Collectives(1)) is cpu
