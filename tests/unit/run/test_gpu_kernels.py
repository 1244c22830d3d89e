"""The wheel's GPU kernels on a given GPU (issue 40 item 6, msdist/run/gpu_kernels.py): machine code up to sm_80 runs
as shipped on 8.x; 9.0 compiles the PTX at the first start, and the plan names the CUDA cache settings that make
it a one-time cost; older than 6.0 cannot run."""
import pytest

from msdist.run import gpu_kernels

CACHE = "/runs/r50/cuda_cache"


@pytest.mark.parametrize("capability", [(6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9)])
def test_gpus_up_to_the_sm_80_family_run_the_shipped_machine_code(capability):
    assert gpu_kernels.runs_as_shipped(capability) and not gpu_kernels.jit_compiles(capability)
    assert "runs as shipped, no JIT compile" in gpu_kernels.kernel_advice([capability], {}, CACHE)


def test_an_h100_compiles_at_first_start_and_is_told_the_cache_settings():
    advice = gpu_kernels.kernel_advice([(9, 0)] * 8, {}, CACHE)
    assert gpu_kernels.jit_compiles((9, 0))
    assert "compute capability 9.0:" in advice and "first start" in advice and "compute_86 PTX" in advice
    assert f"CUDA_CACHE_PATH={CACHE} on a persistent volume" in advice
    assert f"CUDA_CACHE_MAXSIZE={gpu_kernels.CACHE_MAXSIZE}" in advice and "now the default" in advice


def test_the_cache_settings_already_made_are_named_and_a_disabled_cache_is_refused():
    ready = {"CUDA_CACHE_PATH": "/cache/cuda", "CUDA_CACHE_MAXSIZE": str(gpu_kernels.CACHE_MAXSIZE)}
    assert "one-time cost if that folder is on a persistent volume" in gpu_kernels.kernel_advice([(9, 0)], ready, CACHE)
    small = {"CUDA_CACHE_PATH": "/cache/cuda", "CUDA_CACHE_MAXSIZE": "268435456"}
    assert "CUDA_CACHE_PATH=/cache/cuda on a persistent volume" in gpu_kernels.kernel_advice([(9, 0)], small, CACHE)
    assert "now CUDA_CACHE_MAXSIZE=268435456" in gpu_kernels.kernel_advice([(9, 0)], small, CACHE)
    assert "unset it" in gpu_kernels.kernel_advice([(9, 0)], {"CUDA_CACHE_DISABLE": "1"}, CACHE)


def test_a_gpu_older_than_the_oldest_code_and_an_unknown_one():
    assert not gpu_kernels.jit_compiles((5, 2)) and not gpu_kernels.runs_as_shipped((5, 2))
    assert "need 6.0 or newer" in gpu_kernels.kernel_advice([(5, 2)], {}, CACHE)
    assert "compute capability unknown" in gpu_kernels.kernel_advice([], {}, CACHE)


def test_nvidia_smis_compute_cap_query_is_read_per_gpu():
    assert gpu_kernels.parse_compute_caps("9.0\n9.0\n") == [(9, 0), (9, 0)]
    assert gpu_kernels.parse_compute_caps("[N/A]\n8.6\n") == [(8, 6)]
