"""msdist/gpu_bench.py: the GPU acceptance run's arms and its readings of timings and MindSpore's GPU profiler files.

The whole command runs for real on CPU in tests/integration/test_gpu_bench_run.py."""
import pytest

from msdist import gpu_bench
from msdist.gpu_bench import Arm


def test_the_arms_are_one_and_every_device_each_at_one_step_and_the_default():
    assert gpu_bench.plan_arms(8) == [Arm(1, "1"), Arm(1, "auto"), Arm(8, "1"), Arm(8, "auto")]
    assert gpu_bench.plan_arms(1) == [Arm(1, "1"), Arm(1, "auto")]
    assert Arm(8, "auto").name == "8dev_kauto"


def test_the_host_share_is_what_k_steps_per_call_removed():
    assert gpu_bench.host_share(0.010, 0.007) == pytest.approx(0.3)
    assert gpu_bench.host_share(0.010, 0.011) == 0.0   # K gained nothing: no host share shown
    assert gpu_bench.host_share(0.0, 0.01) == 0.0


def _timeline(tmp_path, lines):
    path = tmp_path / "activity_execute_timestamp_0.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def test_the_profilers_kernel_lines_are_read_in_microseconds(tmp_path):
    # MindSpore's format: kernel;stream;start_ns;duration_us (a kernel name may hold ';'-free template text)
    path = _timeline(tmp_path, ["ncclKernel_AllReduce_RING_LL_Sum_float;2;100000;100", "void cudnn::bn<float>;1;0;5.5"])
    assert gpu_bench.read_kernel_timeline(path) == [("ncclKernel_AllReduce_RING_LL_Sum_float", 2, 100.0, 200.0),
                                                    ("void cudnn::bn<float>", 1, 0.0, 5.5)]


def test_overlap_counts_all_reduce_time_beside_compute_on_other_streams_once(tmp_path):
    kernels = gpu_bench.read_kernel_timeline(_timeline(tmp_path, [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL;2;100000;100",   # 100-200 us
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL;2;400000;100",   # 400-500 us: nothing beside it
        "wgrad_conv;1;150000;100",                                # 150-250: covers 150-200
        "dgrad_conv;3;160000;20",                                 # 160-180: inside the same span, counted once
        "other_on_the_nccl_stream;2;100000;300",                  # same stream: not concurrent
    ]))
    assert gpu_bench.overlap_share(kernels) == pytest.approx(50 / 200)
    assert gpu_bench.overlap_share([("wgrad_conv", 1, 0.0, 1.0)]) is None


def test_the_overlap_verdict_says_when_it_cannot_tell(tmp_path):
    cpu = gpu_bench.overlap_verdict("CPU", False, None)
    assert cpu["overlapped"] is None and cpu["why"].startswith("could not tell: a CPU run")
    no_cupti = gpu_bench.overlap_verdict("GPU", False, None)
    assert no_cupti["overlapped"] is None and "libcupti.so" in no_cupti["why"]
    path = _timeline(tmp_path, ["ncclKernel_AllReduce;2;0;10", "gemm;1;0;5"])
    assert gpu_bench.overlap_verdict("GPU", True, path) == {
        "overlapped": True, "share": 0.5, "why": "50.0% of the all-reduce kernels' time ran beside compute kernels"}
    assert gpu_bench.overlap_verdict("GPU", True, None)["overlapped"] is None


def test_the_report_says_a_cpu_run_is_one(tmp_path):
    report = {"device_target": "CPU", "arms": {"1dev_k1": {"images_per_sec": 50.0, "median_step_s": 0.3}},
              "per_device_count": {"1": {"max_weight_difference": 0.0, "host_share": None},
                                   "8": {"max_weight_difference": 2e-7, "host_share": 0.25}},
              "overlap": gpu_bench.overlap_verdict("CPU", False, None)}
    lines = gpu_bench.report_lines(report)
    assert lines[0].startswith("gpu_bench on CPU (no usable GPU here")
    assert "  1 device(s): weights K=1 vs K=auto bitwise equal; host share of a K=1 step not separable on CPU " \
           "(both K run one step per call)" in lines
    assert "  8 device(s): weights K=1 vs K=auto differ by up to 2e-07; host share of a K=1 step 25.0%" in lines
