"""run/config.py on bad input: every command-line or YAML mistake is one ConfigError line (fuzzed with
hypothesis)."""
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msdist.base.errors import ConfigError
from msdist.run import config
from image_trees import _no_hang


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
