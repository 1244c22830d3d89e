"""rank/runtime.py and rank/isa_probe.py: ISA choice applied and cached (and never probed for a GPU run),
cores split among the ranks sharing a mask (`split_shared_mask`, `assumed_masks`), threads split, compile cache
keyed, low precision in effect, compile memory returned.

Timings never appear here (they belong to benchmarks/throughput.py). Each test checks that a
mechanism is in effect, through what oneDNN itself reports or through the cache files."""
import json
import os

import numpy as np
import pytest

from msdist.rank import isa_probe, runtime
from msdist.run import config

Placement = runtime.Placement


@pytest.fixture
def private_isa_cache(tmp_path, monkeypatch):
    """An empty cache dir of our own, on a CPU where msdist has ISAs to probe."""
    if len(isa_probe.candidates(isa_probe.cpu_flags())) < 2:
        pytest.skip("this CPU offers oneDNN a single ISA; nothing is probed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def isa_cache(private_isa_cache, monkeypatch):
    """A private cache dir holding a verdict for this CPU that no real probe would give."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    key = f"{isa_probe.cpu_model()} | mindspore {isa_probe._mindspore_version()}"
    os.makedirs(isa_probe.cache_dir())
    with open(os.path.join(isa_probe.cache_dir(), "cpu_isa.json"), "w", encoding="utf-8") as f:
        json.dump({key: {"isa": "SSE41", "seconds": {}}}, f)

    def no_probe(_isas):
        raise AssertionError("probed although the verdict is cached")
    monkeypatch.setattr(isa_probe, "probe", no_probe)


def test_cached_probe_verdict_is_used_without_probing(isa_cache):
    assert runtime.choose_cpu_isa("auto") == ("SSE41", "probe")


def test_option_beats_probe_and_environment_beats_option(isa_cache, monkeypatch):
    assert runtime.choose_cpu_isa("AVX2") == ("AVX2", "option")
    assert runtime.choose_cpu_isa("default") == ("", "option")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX")
    assert runtime.choose_cpu_isa("AVX2") == ("AVX", "env")


def test_probe_runs_once_and_writes_the_cache(private_isa_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(isa_probe, "probe", lambda isas: calls.append(isas) or {i: (0.5 if i else 1.0) for i in isas})
    first, second = isa_probe.best_isa(), isa_probe.best_isa()
    assert first == second != "" and len(calls) == 1
    with open(os.path.join(str(private_isa_cache), "msdist", "cpu_isa.json"), encoding="utf-8") as f:
        assert list(json.load(f).values())[0]["isa"] == first


def test_a_failed_probe_is_cached_too(private_isa_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(isa_probe, "probe", lambda isas: calls.append(isas) or {i: float("inf") for i in isas})
    assert isa_probe.best_isa() == isa_probe.best_isa() == "" and len(calls) == 1   # oneDNN's default, probed once


# ---------------------------------------------------------------- threads and cores

def test_ranks_on_one_host_split_its_cores(monkeypatch):
    monkeypatch.setattr(runtime, "host_cores", lambda: 4)
    monkeypatch.setattr(runtime, "usable_cores", lambda: (0, 1, 2, 3))
    assert [runtime.place_rank(r, 2) for r in range(2)] == [runtime.Placement(2, (0, 1), "msdist"),
                                                            runtime.Placement(2, (2, 3), "msdist")]
    assert runtime.place_rank(1, 2, bind=False) == runtime.Placement(2)
    assert runtime.place_rank(0, 1) == runtime.Placement(4)
    assert runtime.place_rank(5, 8) == runtime.Placement(1)  # more ranks than cores: one thread, unbound


def test_a_rank_bound_by_its_launcher_keeps_its_cores(monkeypatch):
    monkeypatch.setattr(runtime, "host_cores", lambda: 4)
    monkeypatch.setattr(runtime, "usable_cores", lambda: (2,))  # what mpirun's default --bind-to core leaves
    assert runtime.place_rank(1, 2) == runtime.Placement(1, (2,), "launcher")


def test_a_cpuset_shared_by_the_ranks_is_split_not_oversubscribed(monkeypatch):
    # Slurm / container cpuset: 8 of the host's 16 cores for 4 ranks (the same mask in every rank).
    monkeypatch.setattr(runtime, "host_cores", lambda: 16)
    monkeypatch.setattr(runtime, "usable_cores", lambda: tuple(range(8, 16)))
    assert [runtime.place_rank(r, 4) for r in range(4)] == [
        runtime.Placement(2, (8 + 2 * r, 9 + 2 * r), "msdist") for r in range(4)]


def test_compile_cache_key_changes_with_model_config_and_world_size(tmp_path):
    base = config.parse(["--model", "resnet18"])
    key = runtime.compile_cache_dir(str(tmp_path), config.config_hash(base), 1, 4)
    assert key == runtime.compile_cache_dir(str(tmp_path), config.config_hash(config.parse(["--model", "resnet18"])),
                                            1, 4)
    assert key.startswith(os.path.join(str(tmp_path), "compile_cache"))
    others = {runtime.compile_cache_dir(str(tmp_path), config.config_hash(config.parse(argv)), world, classes)
              for argv, world, classes in ((["--model", "resnet50"], 1, 4),
                                           (["--model", "resnet18", "--image_size", "64"], 1, 4),
                                           (["--model", "resnet18", "--amp_level", "O2"], 1, 4),
                                           (["--model", "resnet18"], 2, 4),
                                           (["--model", "resnet18"], 1, 131))}   # same config, other data set
    assert key not in others and len(others) == 5


def test_amp_levels_run_the_network_in_low_precision():
    import mindspore as ms
    from msdist.engine import step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    images = ms.Tensor(np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32))
    logits = {}
    for level in ("O0", "O2", "O3"):
        ms.set_seed(0)  # the same initial weights for every level
        net = step.mixed_precision(step.build_network("resnet_tiny", 4, False, False, 1), level, "float16")
        net.set_train(False)
        out = net(images)
        assert out.dtype == ms.float32  # the loss always sees float32 logits
        logits[level] = out.asnumpy().astype(np.float64)
    for level in ("O2", "O3"):
        gap = np.abs(logits[level] - logits["O0"]).max()
        assert 0 < gap < 1e-2, (level, gap)  # float16 rounding, not float32 and not garbage


# ---------------------------------------------------------------- memory after compiling

def _resident_mb() -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def test_memory_freed_after_compiling_goes_back_to_the_os():
    """What glibc keeps after a compiler frees many small blocks: 100 MB of them, with every 64th block
    still in use, so the heap can neither shrink nor hand the pages back by itself.
    release_compile_memory must return them."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(25_600)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)   # resident, not just reserved
    for i, block in enumerate(blocks):
        if i % 64:
            libc.free(block)
    before = _resident_mb()
    runtime.release_compile_memory()
    after = _resident_mb()
    for block in blocks[::64]:
        libc.free(block)
    assert before - after > 50, (before, after)


def test_gpu_runs_never_probe_the_cpu_isa(monkeypatch):
    from msdist.rank import isa_probe, runtime

    assert not runtime.needs_cpu_isa("GPU") and runtime.needs_cpu_isa("CPU") and runtime.needs_cpu_isa("auto")
    for name in ("GLOG_v", "GLOG_minloglevel", "OMP_NUM_THREADS"):  # prepare() sets them: restore afterwards
        monkeypatch.setenv(name, "")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def no_probe(*_args):
        raise AssertionError("the oneDNN ISA was probed for a GPU run")
    monkeypatch.setattr(isa_probe, "best_isa", no_probe)
    rt = runtime.prepare(cpu_isa="auto", device_target="GPU")
    assert (rt.cpu_isa, rt.isa_source) == ("default", "not used on GPU")
    assert "ONEDNN_MAX_CPU_ISA" not in __import__("os").environ



def cores(first, count):
    return tuple(range(first, first + count))


def placements(masks, bind=True):
    return [runtime.split_shared_mask(rank, masks, bind) for rank in range(len(masks))]


def assert_no_core_idle_or_shared(masks, placed):
    used = [c for p in placed for c in p.cores]
    assert len(used) == len(set(used)), "a core is shared"
    assert set(used) == {c for mask in masks for c in mask}, "a core is idle"


# mpirun --bind-to socket (its default above 2 ranks) on 2 sockets x 32 cores, --map-by socket: ranks alternate.
SOCKETS = [cores(0, 32) if rank % 2 == 0 else cores(32, 32) for rank in range(8)]


# Slurm: the job's cgroup cpuset on this node, 24 of 64 cores, the same for its 4 tasks (no --cpu-bind).
SLURM_CPUSET = [cores(40, 24)] * 4


# A container limited to cores 4-11 (docker --cpuset-cpus=4-11), 3 ranks: 8 does not divide by 3.
CONTAINER_CPUSET = [cores(4, 8)] * 3


# mpirun --bind-to core (its default for up to 2 ranks) or srun --cpu-bind=cores: one core each.
CORE_BOUND = [(5,), (6,)]


@pytest.mark.parametrize("masks, expected", [
    (SOCKETS, [Placement(8, cores(8 * (r // 2) + 32 * (r % 2), 8), "msdist") for r in range(8)]),
    (SLURM_CPUSET, [Placement(6, cores(40 + 6 * r, 6), "msdist") for r in range(4)]),
    (CONTAINER_CPUSET, [Placement(3, cores(4, 3), "msdist"), Placement(3, cores(7, 3), "msdist"),
                        Placement(2, cores(10, 2), "msdist")]),
    (CORE_BOUND, [Placement(1, (5,), "launcher"), Placement(1, (6,), "launcher")]),
], ids=["sockets", "slurm cpuset", "container cpuset", "core-bound"])
def test_ranks_sharing_a_mask_split_that_mask_among_themselves(masks, expected):
    placed = placements(masks)
    assert placed == expected
    assert_no_core_idle_or_shared(masks, placed)


def test_socket_binding_no_longer_leaves_half_the_host_idle():
    """The issue's case: before, each rank took 1/8 of its socket (4 cores) and 32 of 64 cores idled."""
    assert sum(p.threads for p in placements(SOCKETS)) == 64


def test_unbound_threads_follow_the_same_split_and_a_lone_rank_keeps_everything():
    assert [p.threads for p in placements(CONTAINER_CPUSET, bind=False)] == [3, 3, 2]
    assert all(not p.cores for p in placements(CONTAINER_CPUSET, bind=False))
    assert runtime.split_shared_mask(0, [cores(0, 16)]) == Placement(16)
    assert runtime.split_shared_mask(5, [cores(0, 4)] * 8) == Placement(1)  # more ranks than cores: unbound


@pytest.mark.parametrize("mine, world, host, shared", [
    (cores(0, 64), 8, 64, True),     # unbound or one cpuset for all: shared by every local rank
    (cores(0, 32), 8, 64, True),     # a socket, without the others' masks: the old (pessimistic) guess
    ((3,), 2, 4, False),             # a core of its own: the launcher's binding
    (cores(0, 2), 2, 4, False),      # exactly its share
])
def test_a_rank_that_cannot_learn_the_others_masks_guesses(mine, world, host, shared):
    masks = runtime.assumed_masks(mine, 1, world, host)
    assert masks[1] == mine and len(masks) == world
    assert (masks.count(mine) == world) == shared
