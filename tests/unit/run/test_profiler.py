"""run/profiler.py: the window's options, the GPU decision without CUPTI, and no profiler outside the window."""
import os

import pytest

from msdist.base.errors import ConfigError
from msdist.rank import gpu_plugin
from msdist.run import config, options, profiler
from msdist.run.profiler import ProfileWindow, StepProfiler


def test_the_window_and_ranks_parse_or_are_refused_in_one_line():
    assert profiler.parse_steps("") is None and profiler.parse_steps("20:25") == (20, 25)
    assert profiler.parse_steps("7:7") == (7, 7)
    for bad in ("5:3", "0:2", "3", "a:b", "3:"):
        with pytest.raises(ConfigError, match="--profile_steps"):
            profiler.parse_steps(bad)
    assert profiler.parse_ranks("0") == (0,) and profiler.parse_ranks("3, 0,3") == (0, 3)
    assert profiler.parse_ranks("ALL") is None
    with pytest.raises(ConfigError, match="--profile_ranks"):
        profiler.parse_ranks("-1")
    with pytest.raises(ConfigError, match="--profile_steps '9:2'"):
        config.parse(["--profile_steps", "9:2"])


def test_options_resolve_the_window_into_plain_values():
    cfg = config.parse(["--profile_steps", "3:5", "--profile_ranks", "all", "--straggler_margin", "0.3"])
    assert options.profile_window(cfg) == ProfileWindow(3, 5, None)
    assert options.straggler_rule(cfg).margin == 0.3 and options.straggler_rule(cfg).windows == 2
    defaults = config.parse([])
    assert options.profile_window(defaults) is None and options.straggler_rule(defaults).on


def test_gpu_traces_device_kernels_only_with_cupti_and_says_so_without():
    assert profiler.activities("CPU", False) == (("CPU",), "")
    assert profiler.activities("GPU", True) == (("CPU", "GPU"), "")
    names, note = profiler.activities("GPU", False)
    assert names == ("CPU",) and "libcupti.so" in note and "LD_LIBRARY_PATH" in note


def test_cupti_is_found_where_the_dynamic_linker_looks(tmp_path):
    extras = tmp_path / "usr" / "local" / "cuda" / "extras" / "CUPTI" / "lib64"
    extras.mkdir(parents=True)
    (extras / "libcupti.so").write_bytes(b"")
    assert not gpu_plugin.findable(profiler.CUPTI, str(tmp_path), {})
    assert gpu_plugin.findable(profiler.CUPTI, str(tmp_path), {"LD_LIBRARY_PATH": "/usr/local/cuda/extras/CUPTI/lib64"})


def test_no_profiler_outside_the_window_or_its_ranks(tmp_path):
    window = ProfileWindow(3, 5, (0,))
    assert StepProfiler.open(None, 0, "CPU", str(tmp_path), 0) is None
    assert StepProfiler.open(window, 1, "CPU", str(tmp_path), 0) is None
    assert StepProfiler.open(window, 0, "CPU", str(tmp_path), 5) is None   # resumed past the window
    inside = StepProfiler.open(window, 0, "CPU", str(tmp_path), 0)
    inside.before_step(2)
    inside.after_step(2)
    assert inside.directory == os.path.join(str(tmp_path), "profile", "rank_0") and not os.listdir(tmp_path)
