"""`python -m msdist.plan_scale` (#35): the forecast's arithmetic on hand-computed cases, the bucket order taken from
the real network, the refusals, and the --json document. No timing: the published and local comparisons live in
benchmarks/scaling_validation.py (docs/scaling.md)."""
import os

import pytest

from conftest import REPO
from msdist.run import config, forecast, hardware
from msdist.run.forecast import Compute, Gradients, Message, Network
from msdist.run.hardware import Link


R18_CONFIG = os.path.join(REPO, "configs", "resnet18_fruits360.yaml")


def _link(gbs: float, us: float) -> Link:
    return Link("test", gbs, us, "test")


def test_one_bucket_one_node_is_latency_plus_ring_bytes_over_busbw():
    # 100 MB over 4 ranks at 10 GB/s, 5 us: 5e-6 + 2 * 3/4 * 1e8 / 1e10 = 0.015005 s
    net = Network(_link(10, 5), _link(1, 1000), gpus_per_node=8)
    assert forecast.hierarchical_allreduce_seconds(100e6, 4, net) == pytest.approx(0.015005)
    assert forecast.hierarchical_allreduce_seconds(100e6, 1, net) == 0.0


def test_two_nodes_reduce_inside_then_across_nodes():
    # 16 GPUs, 8 per node, 80 MB: inside 10e-6 + 2*7/8 * 80e6/100e9 = 1.41e-3; across the 2 nodes
    # 20e-6 + 2*1/2 * 80e6/10e9 = 8.02e-3; together 9.43e-3 s
    net = Network(_link(100, 10), _link(10, 20), gpus_per_node=8)
    assert forecast.hierarchical_allreduce_seconds(80e6, 16, net) == pytest.approx(9.43e-3)
    assert forecast.nodes(16, 8) == 2


def test_allgather_grows_with_the_ranks():
    # 1000 bytes per rank on one 1 GB/s node, no latency: (n-1) * 1000 / 1e9
    net = Network(_link(1, 0), _link(0.1, 0), gpus_per_node=8)
    assert forecast.allgather_seconds(1000, 4, net) == pytest.approx(3e-6)
    # 16 ranks on 2 nodes: inside (8-1)*2*1000/1e9 = 14e-6, across (2-1)*8*1000/0.1e9 = 80e-6
    assert forecast.allgather_seconds(1000, 16, net) == pytest.approx(94e-6)


def test_backward_runs_from_the_last_parameter():
    assert forecast.backward_done([1, 2, 3]) == pytest.approx([1.0, 5 / 6, 3 / 6])


def test_exposed_communication_is_what_runs_past_the_end_of_backward():
    # backward 10 ms; a bucket ready at half of it taking 3 ms ends at 8 ms (hidden), the last one ready at 10 ms
    # taking 2 ms ends at 12 ms: 2 ms exposed
    assert forecast.exposed_seconds([Message(0.5, 3e-3), Message(1.0, 2e-3)], 10e-3) == pytest.approx(2e-3)
    # a long first bucket delays the next one on the same stream: 5 + 7 = 12, then 14 ms: 4 ms exposed
    assert forecast.exposed_seconds([Message(0.5, 7e-3), Message(1.0, 2e-3)], 10e-3) == pytest.approx(4e-3)


class _Bucket:
    def __init__(self, first, nbytes):
        self.first, self.nbytes = first, nbytes


def test_rows_add_compute_exposed_exchange_and_host_work():
    # one 10 MB bucket of the first parameter (ready when backward ends), 2 ranks at 1 GB/s, no latency:
    # all-reduce 2 * 1/2 * 1e7 / 1e9 = 10 ms, all exposed; compute 4 images * 5 ms = 20 ms; host 1 ms
    grads = Gradients([_Bucket(0, 10_000_000)], [("w", 10_000_000)], [1.0])
    net = Network(_link(1, 0), _link(1, 0), gpus_per_node=8)
    table = forecast.forecast("none", grads, Compute(5.0, 1.0), net, global_batch=8, per_gpu_batch=None,
                              input_us=1000.0, scales=(1, 2, 4, 8, 16))
    one, two = table.rows[:2]
    assert (one.step_ms, one.exposed_ms, one.efficiency) == pytest.approx((41.0, 0.0, 1.0))
    assert (two.per_gpu_batch, two.compute_ms, two.exposed_ms, two.step_ms) == pytest.approx((4, 20, 10, 31))
    assert two.images_per_sec == pytest.approx(2 * 4 / 0.031)
    assert two.efficiency == pytest.approx((8 / 0.031) / (2 * 8 / 0.041))
    assert two.input_cores_per_gpu == pytest.approx(4 / 0.031 * 1000 / 1e6)
    assert [r.gpus for r in table.rows] == [1, 2, 4, 8]  # strong scaling stops below one image per GPU
    # weak scaling keeps the batch per GPU; fp16 halves the bytes
    weak = forecast.forecast("fp16", grads, Compute(5.0, 1.0), net, 8, 4, 1000.0, scales=(1, 2, 16))
    assert [r.per_gpu_batch for r in weak.rows] == [4, 4, 4]
    assert weak.rows[1].exposed_ms == pytest.approx(5.0)
    # efficiency is per GPU against the table's first row, whatever N it starts at
    from_two = forecast.forecast("none", grads, Compute(5.0, 1.0), net, 8, 4, 0.0, scales=(2, 4)).rows
    assert from_two[0].efficiency == 1.0
    assert from_two[1].efficiency == pytest.approx(from_two[1].images_per_sec / 4 / (from_two[0].images_per_sec / 2))


def test_the_first_dominated_n_is_where_exposed_reaches_compute():
    grads = Gradients([_Bucket(0, 10_000_000)], [("w", 10_000_000)], [1.0])
    net = Network(_link(1, 0), _link(1, 0), gpus_per_node=8)
    # 2 ranks: exposed 10 ms < compute 20 ms; 4 ranks: exposed 15 ms >= compute 10 ms
    table = forecast.forecast("none", grads, Compute(5.0, 0.0), net, 8, None, 0.0, scales=(1, 2, 4))
    assert [r.dominated for r in table.rows] == [False, False, True]
    assert table.first_dominated() == 4


def test_a_cpu_rank_hides_no_exchange_and_fp16_halves_each_bucket():
    # 2 ranks at 1 GB/s, 1 ms latency. Two parameters of equal cost: 'a' (first) and 'b' (last), a bucket each,
    # 'b' (ready at half of backward) sent first, then 'a' (ready at its end): 1 + 6 ms, 1 + 4 ms.
    # compute 4 images x 5 ms = 20 ms, backward 2/3 of it = 13.33 ms.
    grads = Gradients([_Bucket(1, 6_000_000), _Bucket(0, 4_000_000)], [("a", 4_000_000), ("b", 6_000_000)],
                      [1.0, 1.0])
    net = Network(_link(1, 1000), _link(1, 1000), gpus_per_node=8)
    row = forecast.forecast("none", grads, Compute(5.0, 0.0), net, 8, 4, 0.0, scales=(2,)).rows[0]
    # GPU: 'b' runs 6.67..13.67 ms, 'a' 13.67..18.67 ms: 18.67 - 13.33 = 5.33 ms exposed
    assert row.exposed_ms == pytest.approx(16 / 3)
    # CPU: the ring runs on the rank's own cores, after backward: 7 + 5 = 12 ms, all of it exposed
    cpu = forecast.forecast("none", grads, Compute(5.0, 0.0, hides_exchange=False), net, 8, 4, 0.0, scales=(2,))
    assert (cpu.rows[0].exposed_ms, cpu.rows[0].step_ms) == pytest.approx((12.0, 32.0))
    # fp16: half the bytes: 'b' runs 6.67..10.67 ms, 'a' 13.33..16.33 ms: 3 ms exposed
    fp16 = forecast.forecast("fp16", grads, Compute(5.0, 0.0), net, 8, 4, 0.0, scales=(2,))
    assert fp16.rows[0].exposed_ms == pytest.approx(3.0)


@pytest.mark.slow  # builds ResNet-18 and ResNet-50 and runs a PyNative forward
def test_buckets_and_backward_costs_come_from_the_real_network():
    from models import create_model
    from msdist.engine import buckets
    from msdist.run.network_cost import network_gradients
    grads = network_gradients("resnet18", 1000, 224, "auto")
    names = [n for n, _ in buckets.parameter_sizes(create_model("resnet18", 1000))]
    assert [n for n, _ in grads.sizes] == names
    sent = [n for b in grads.buckets for n in reversed(b.names)]
    assert sent == names[::-1]  # contiguous runs, the last layers' bucket first
    assert grads.buckets[0].names[-1] == "fc.bias"
    assert all(b.nbytes <= buckets.DEFAULT_BUCKET_BYTES for b in grads.buckets if len(b.names) > 1)
    # multiply-adds of one forward pass at 224 px: torchvision lists 1.81 G for ResNet-18
    assert sum(grads.costs) == pytest.approx(hardware.GFLOPS_224["resnet18"] * 1e9, rel=0.02)
    assert grads.costs[names.index("fc.weight")] == 512 * 1000
    one_group = network_gradients("resnet18", 1000, 32, "")
    assert len(one_group.buckets) == 1 and one_group.buckets[0].first == 0
    split = network_gradients("resnet18", 1000, 32, "30")  # cut after parameter 30, network order
    assert [(b.first, b.last) for b in split.buckets] == [(31, len(names) - 1), (0, 30)]


def _parse(*args):
    from msdist import plan_scale
    return plan_scale.resolve(config.parse(["--config", R18_CONFIG, *args], options=plan_scale.OPTIONS))


def test_step_ms_is_the_one_gpu_step_and_the_gpu_table_scales_by_pixels():
    setup = _parse("--step_ms", "50", "--batch_size", "32")
    assert setup.compute.ms_per_image * 32 + setup.compute.host_ms == pytest.approx(50)
    a100 = _parse("--gpu", "A100", "--image_size", "112", "--amp_level", "O0")
    rate = hardware.gpu_throughput("A100", "resnet18", "fp32").images_per_sec
    assert a100.compute.ms_per_image == pytest.approx(1000 / rate / 4)
    assert a100.network.intra.name == "nvlink-a100" and a100.network.inter.name == hardware.DEFAULT_INTER
    edited = _parse("--gpu", "V100", "--network", "eth25", "--intra_busbw", "50", "--latency_us", "3")
    assert (edited.network.intra.busbw_gbs, edited.network.intra.latency_us) == (50, 3)
    assert edited.network.inter.busbw_gbs == pytest.approx(25 / 8 * hardware.LINK_EFFICIENCY)
