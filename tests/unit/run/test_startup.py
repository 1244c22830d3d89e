"""run/startup.py: the start-up decisions that do not need MindSpore."""


def test_compile_cache_key_uses_the_resolved_device_and_amp_level(tmp_path, data_dir):
    """A run directory started on CPU and resumed on GPU must not load the CPU graph: the key holds the device
    `auto` resolved to, and the amp level `auto` resolved to there (O0 on CPU, O2 on GPU)."""
    from msdist.rank import runtime
    from msdist.run import config, startup

    def key(argv, target):
        return startup.compile_cache_path(config.parse(["--data_dir", data_dir, "--output_dir", str(tmp_path), *argv]), 2,
                                          target, 2)
    assert key([], "CPU") == key(["--device_target", "CPU"], "CPU")  # what was asked does not matter
    assert key([], "CPU") != key([], "GPU")
    assert runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "GPU", "O2") != \
        runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "GPU", "O0")
    # Two ranks running a 4-slot job's batch (resumed after a shrink) compile another step than 2 slots' do.
    assert runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "CPU", "O0", batch_slots=4) != \
        runtime.compile_cache_dir(str(tmp_path), "cfg", 2, 4, "CPU", "O0", batch_slots=2)
