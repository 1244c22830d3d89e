"""run/config.py: every shipped config parses, YAML < command line, unknown keys and models refused before
MindSpore loads, old option names, the resolved config round-trips and is written whole; on bad input, every
command-line or YAML mistake is one ConfigError line (fuzzed with hypothesis)."""
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO, TINY_CONFIG
from image_trees import _no_hang
from msdist.base.errors import ConfigError
from msdist.run import config, startup


def test_every_config_parses():
    names = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".yaml"))
    assert {"resnet50_fruits360.yaml", "resnet18_fruits360.yaml", "tiny_test.yaml"} <= set(names)
    for name in names:
        cfg = config.parse(["--config", os.path.join(REPO, "configs", name)])
        assert cfg.model and cfg.batch_size > 0, name
        # What msdist.train checks before MindSpore loads (model name, batch splits), for 1 to 8 ranks.
        for world in (1, 2, 4, 8):
            startup.check_model(cfg, world)
            startup.check_batch_split(cfg, world)


def test_a_config_with_an_unknown_model_is_refused_before_mindspore(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: resnet5\n")
    with pytest.raises(ConfigError, match="unknown model 'resnet5'; did you mean resnet50"):
        startup.check_model(config.parse(["--config", str(bad)]), 1)


def test_seed_config_matches_the_tutorial():
    """The tutorial's recipe, but float32 without its fixed scale 1024: under amp O0 it changed nothing numerically
    and cost the per-step overflow check (issue 32 item 8)."""
    cfg = config.parse(["--config", os.path.join(REPO, "configs", "resnet50_fruits360.yaml")])
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.momentum, cfg.loss_scale, cfg.epochs, cfg.image_size) == \
        ("resnet50", 32, 0.01, 0.9, "auto", 10, 100)


def test_cli_overrides_yaml_and_rejects_unknown_keys(tmp_path):
    cfg = config.parse(["--config", TINY_CONFIG, "--lr", "0.5", "--augment", "false"])
    assert cfg.lr == 0.5 and cfg.augment is False and cfg.model == "resnet_tiny"
    with pytest.raises(ConfigError, match="did you mean --epochs"):
        config.parse(["--epochs_num", "3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 4\n")
    with pytest.raises(ConfigError, match="batch_sise.*did you mean --batch_size"):
        config.parse(["--config", str(bad)])


def test_resolved_config_round_trips(tmp_path):
    cfg = config.parse(["--config", TINY_CONFIG, "--seed", "7"])
    path = tmp_path / "config.yaml"
    config.save(cfg, str(path))
    again = config.parse(["--config", str(path)])
    assert vars(again) == {**vars(cfg), "config": str(path)}
    assert config.config_hash(again) == config.config_hash(cfg)


def test_config_yaml_is_replaced_whole_never_rewritten_in_place(tmp_path):
    """A reader (or a run killed mid-write) sees the old config.yaml or the new one, never a truncated one."""
    path = tmp_path / "config.yaml"
    path.write_text("seed: 1\n")
    with open(path, encoding="utf-8") as reader:  # opened before the save: still the old file after it
        config.save(config.parse(["--config", TINY_CONFIG, "--seed", "7"]), str(path))
        assert reader.read() == "seed: 1\n"
    assert config.parse(["--config", str(path)]).seed == 7
    assert os.listdir(tmp_path) == ["config.yaml"]  # no temporary file left beside it


def test_old_option_names_work_in_yaml_with_the_command_line_notice(tmp_path, capsys):
    """A YAML file with a renamed key (stall.RENAMED) is read as with the current name, and says so in the same
    one line as on the command line, naming the file; once per file, though msdist.launch reads it twice."""
    from msdist import launch
    old = tmp_path / "old.yaml"
    old.write_text("startup_timeout: 90\nheartbeat_timeout: 15\n")
    current = tmp_path / "current.yaml"
    current.write_text("stall_startup_timeout: 90\nstall_silence_timeout: 15\n")
    capsys.readouterr()
    cfg = config.parse(["--config", str(old)])
    assert vars(cfg) == {**vars(config.parse(["--config", str(current)])), "config": str(old)}
    assert capsys.readouterr().err.splitlines() == [
        f"msdist: {old}: --startup_timeout is now --stall_startup_timeout (docs/launch.md#stall-options)",
        f"msdist: {old}: --heartbeat_timeout is now --stall_silence_timeout (docs/launch.md#stall-options)"]
    relaunched = tmp_path / "relaunched.yaml"
    relaunched.write_text("startup_timeout: 90\n")
    plan = launch.parse_args(["-n", "2", "--config", str(relaunched)])
    config.parse(plan.train_args)  # msdist.launch's path checks read the file again: no second notice
    assert plan.stall.stall_startup_timeout == 90
    assert capsys.readouterr().err.splitlines() == [
        f"msdist: {relaunched}: --startup_timeout is now --stall_startup_timeout (docs/launch.md#stall-options)"]
    both = tmp_path / "both.yaml"
    both.write_text("startup_timeout: 90\nstall_startup_timeout: 60\n")
    with pytest.raises(ConfigError, match="sets both startup_timeout and stall_startup_timeout; keep stall_startup_timeout"):
        config.parse(["--config", str(both)])


def test_only_rank_0_and_not_the_ranks_of_msdist_launch_give_the_renamed_notice(tmp_path, capsys, monkeypatch):
    path = tmp_path / "old.yaml"
    path.write_text("startup_timeout: 90\n")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert config.parse(["--config", str(path), "--heartbeat_timeout", "15"]).stall_startup_timeout == 90
    assert capsys.readouterr().err == ""
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("MS_NODE_ID", "0")
    monkeypatch.setenv("MS_WORKER_NUM", "2")
    monkeypatch.setenv("MSDIST_LOCAL_RANK", "0")  # started by msdist.launch, which said it already
    other = tmp_path / "other.yaml"  # not `path`: the notice is said once per file
    other.write_text("startup_timeout: 90\n")
    assert config.parse(["--config", str(other)]).stall_startup_timeout == 90
    assert capsys.readouterr().err == ""


def test_gpu_config_is_the_8_gpu_recipe():
    import os
    from conftest import REPO
    from msdist.run import config

    cfg = config.parse(["--config", os.path.join(REPO, "configs", "resnet50_fruits360_gpu.yaml")])
    assert 64 <= cfg.batch_size // 8 <= 128 and cfg.batch_size % 8 == 0  # per GPU on 8 GPUs
    # a fixed global batch, so a fixed LR (0.1 per 256 images) on 1, 4 or 8 GPUs; BatchNorm sees 1024 / N per GPU
    assert not cfg.scale_lr and cfg.lr == 0.1 * cfg.batch_size / 256
    assert cfg.warmup_epochs > 0 and cfg.amp_level == "auto" and cfg.loss_scale == "auto"
    assert config.fusion_split(cfg.allreduce_fusion) is None  # auto: byte buckets in network order


@pytest.mark.parametrize("argv, words", [
    (["--epochs_num", "3"], ["unknown option --epochs_num", "did you mean --epochs?"]),
    (["--lr", "abc"], ["--lr", "invalid float value"]),
    (["--lr", "-0.1"], ["lr=-0.1 must be > 0"]),
    (["--batch_size", "0"], ["batch_size=0 must be >= 1"]),
    (["--bad_images", "ignore"], ["--bad_images='ignore' is not one of error, skip"]),
    (["--dist_bn", "reduse"], ["--dist_bn='reduse' is not one of reduce, broadcast, none (did you mean reduce?)"]),
    (["--overwrite", "maybe"], ["--overwrite"]),
    (["--config", "no/such.yaml"], ["config file 'no/such.yaml' not found"]),
])
def test_cli_config_errors_are_one_clear_line(argv, words):
    with pytest.raises(ConfigError) as err:
        config.parse(argv)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("epochs_num: 3\n", ["unknown key 'epochs_num'", "did you mean --epochs?"]),
    ("lr: fast\n", ["lr: could not convert"]),
    ("batch_size: 0\n", ["batch_size=0 must be >= 1"]),
    ("bad_images: maybe\n", ["bad_images='maybe' is not one of error, skip"]),
    ("seed: 2020-13-45\n", ["not valid YAML"]),
    ("- a list\n", ["must be a mapping"]),
])
def test_yaml_config_errors_are_one_clear_line(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.parse(["--config", str(path)])
    for word in words:
        assert word in str(err.value)


_YAML_KEYS = [o.name for o in config.TRAIN_OPTIONS] + ["epochs_num", "config"]


_YAML_VALUES = st.one_of(st.text(max_size=20), st.integers().map(str), st.floats().map(str), st.sampled_from(
    ["~", "[1, 2]", "{a: 1}", "&a [*a]", ".nan", "-.inf", "1e400", "0x1F", "2020-13-45", "!!binary aGk=",
     "!!python/object:os.system", "true", "'no'", "[[[[[[[[[[[[[[]]]]]]]]]]]]]]"]))


_YAML_TEXTS = st.one_of(
    st.text(max_size=300),
    st.lists(st.tuples(st.sampled_from(_YAML_KEYS), _YAML_VALUES), max_size=5).map(
        lambda pairs: "".join(f"{k}: {v}\n" for k, v in pairs)),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")))


@settings(max_examples=300, deadline=2000, derandomize=True)
@given(text=_YAML_TEXTS)
def test_random_yaml_config_parses_or_raises_config_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "random.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        try:
            with _no_hang():
                config.parse(["--config", path])
        except ConfigError as e:
            assert str(e).strip()


@settings(max_examples=200, deadline=2000, derandomize=True)
@given(argv=st.lists(st.one_of(st.sampled_from([f"--{k}" for k in _YAML_KEYS]), st.text(max_size=12)),
                     max_size=6).filter(lambda a: not {"-h", "--help"} & set(a)))
def test_random_command_line_parses_or_raises_config_error(argv):
    try:
        with _no_hang():
            config.parse(argv)
    except ConfigError as e:
        assert str(e).strip()
