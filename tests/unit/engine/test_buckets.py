"""Gradient buckets (#32 item 4, msdist/engine/buckets.py, step.bucket_gradients): contiguous in network
order, cut by bytes, sent last layers first; and, in the step MindSpore compiles for `--loss_scale dynamic`
on 2 real ranks, no bucket's all-reduce depends on a gradient outside it (read from the saved IR)."""
import glob
import os
import re

import numpy as np
import pytest

from conftest import run_msdist, tiny_args
from msdist.engine import buckets

MB = 2 ** 20

# (first, last parameter index, first name, last name) of each bucket, in send order, at 1000 classes.
EXPECTED = {
    "resnet18": [(49, 61, "stages.3.0.bn2.gamma", "fc.bias"),
                 (0, 48, "stem.0.weight", "stages.3.0.conv2.weight")],
    "resnet50": [(148, 160, "stages.3.1.bn3.gamma", "fc.bias"),
                 (139, 147, "stages.3.0.downsample.bn.gamma", "stages.3.1.conv3.weight"),
                 (124, 138, "stages.2.5.bn2.gamma", "stages.3.0.downsample.conv.weight"),
                 (76, 123, "stages.2.0.bn2.gamma", "stages.2.5.conv2.weight"),
                 (0, 75, "stem.0.weight", "stages.2.0.conv2.weight")],
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_auto_buckets_of_resnets_are_contiguous_by_bytes_and_last_layers_first(model):
    from models import create_model
    net = create_model(model, 1000)
    sizes = buckets.parameter_sizes(net)
    assert [name for name, _ in sizes] == [p.name for p in net.trainable_params()]
    plan = buckets.plan_buckets(sizes)
    assert [(b.first, b.last, b.names[0], b.names[-1]) for b in plan] == EXPECTED[model]
    # Every parameter exactly once, each bucket one contiguous run, the runs descending: the first sent holds fc.
    assert [n for b in reversed(plan) for n in b.names] == [name for name, _ in sizes]
    assert all(b.names == tuple(n for n, _ in sizes[b.first:b.last + 1]) for b in plan)
    assert all(b.nbytes <= buckets.DEFAULT_BUCKET_BYTES for b in plan)
    assert all(b.nbytes == sum(s for _, s in sizes[b.first:b.last + 1]) for b in plan)


def test_a_parameter_larger_than_a_bucket_goes_alone_and_explicit_cuts_keep_send_order():
    sizes = [("a", 4), ("b", 4), ("big", 40), ("c", 4), ("d", 4)]
    assert [b.names for b in buckets.plan_buckets(sizes, 10)] == [("c", "d"), ("big",), ("a", "b")]
    assert buckets.plan_buckets([], 10) == []
    assert [b.names for b in buckets.cut_after(sizes, [1, 2])] == [("c", "d"), ("big",), ("a", "b")]
    assert [b.names for b in buckets.cut_after(sizes, [])] == [("a", "b", "big", "c", "d")]


def test_mindspore_cuts_each_bucket_past_its_threshold_in_256_kb_units():
    # One bucket of 3 MB: the step sets comm_fusion config ceil(3) + 1 = 4, which MindSpore's fusion pass reads as
    # 4 x 262144 = 1 MB. Walking a, b, c, d, e (0.5, 0.4, 0.3, 0.2, 1.6 MB): a + b = 0.9 MB; c would make 1.2 and
    # ends the op, itself in it; then d = 0.2, e would make 1.8 and ends the next one. Sent last layers first.
    sizes = [("a", MB // 2), ("b", 4 * MB // 10), ("c", 3 * MB // 10), ("d", 2 * MB // 10), ("e", 16 * MB // 10)]
    sizes[-1] = ("e", 3 * MB - sum(n for _, n in sizes[:-1]))  # exactly 3 MB in all
    plan = buckets.cut_after(sizes, [])
    assert buckets.fusion_config(plan) == 4
    assert [b.names for b in buckets.backend_segments(sizes, plan)] == [("d", "e"), ("a", "b", "c")]
    # two buckets are cut each on its own, and a bucket under the threshold stays whole
    two = buckets.cut_after(sizes, [1])
    assert [b.names for b in buckets.backend_segments(sizes, two)] == [("c", "d", "e"), ("a", "b")]


@pytest.mark.parametrize("model, counts", [("resnet18", [4, 3, 6, 3, 6, 40]),
                                           ("resnet50", [7, 3, 6, 6, 3, 3, 9, 18, 15, 15, 76])])
def test_resnets_compile_to_the_allreduce_ops_of_their_saved_ir(model, counts):
    """`MS_DEV_SAVE_GRAPHS=1 mpirun -n 2 python -m msdist.train --model M ...` (4 classes), the final kernel graph
    (hwopt_common_final_graph_*.ir): ResNet-18's holds six AllReduce ops of 40, 6, 3 (fusion 2) and 6, 3, 4
    (fusion 1) gradients, ResNet-50's eleven of these counts."""
    from models import create_model
    sizes = buckets.parameter_sizes(create_model(model, 4))
    sends = buckets.backend_segments(sizes, buckets.plan_buckets(sizes))
    assert [len(b.names) for b in sends] == counts


def test_the_optimizer_lists_parameters_in_network_order():
    """MindSpore lists grouped parameters group by group (decayed weights, then BatchNorm and biases) unless
    `order_params` is given: the gradient tuple, and so every bucket, follows this list."""
    from msdist.engine import optim, step
    net = step.build_network("resnet18", 10, False, False, 1)
    for backbone_lr_scale in (1.0, 0.1):
        optimizer = optim.create_optimizer(net.trainable_params(), np.full(4, 0.1, np.float32), 0.9, 1e-4,
                                           backbone_lr_scale)
        assert [p.name for p in optimizer.parameters] == [p.name for p in net.trainable_params()]


def test_float16_reducer_sends_the_same_buckets_and_returns_parameter_order():
    from msdist.engine import reducers, step
    net = step.build_network("resnet18", 10, False, False, 1)
    plan = buckets.plan_buckets(buckets.parameter_sizes(net), 8 * MB)
    reducer = reducers.Fp16BucketAllReduce(net.trainable_params(), 2, plan)
    assert reducer.runs == tuple((b.first, b.last + 1) for b in plan) and reducer.runs[0][1] == len(plan[0].names) + \
        plan[0].first
    sent = [i for start, end in reducer.runs for i in range(start, end)]
    assert [sent[p] for p in reducer.position] == list(range(len(sent)))


# ---------------------------------------------------------------- the compiled graph, 2 real ranks

_NODE = re.compile(r"^\s+%(\d+)\([^)]*\) = ([\w.]+)\((.*)$")


def _kernel_graph_nodes(path: str) -> dict:
    """{node id: (op name, input node ids, the line)} of one saved kernel-graph IR file."""
    nodes = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            match = _NODE.match(line)
            if match:
                nodes[int(match.group(1))] = (match.group(2), [int(i) for i in re.findall(r"%(\d+)\b", match.group(3))],
                                              line)
    return nodes


def _ancestors(nodes: dict, start: int) -> set:
    seen, todo = set(), list(nodes[start][1])
    while todo:
        node = todo.pop()
        if node in seen or node not in nodes:
            continue
        seen.add(node)
        todo.extend(nodes[node][1])
    return seen


@pytest.mark.multiprocess
def test_no_bucket_all_reduce_waits_for_gradients_outside_it_with_a_dynamic_scale(data_dir, tmp_path):
    """The IR MindSpore saves (save_graphs) of a 2-rank CPU run, `--loss_scale dynamic`, three buckets of
    resnet_tiny: each fused AllReduce reads the weight gradients (Conv2DBackpropFilter) of its own bucket's
    convolutions only, and no other collective comes before it. An overflow flag all-reduced before the
    exchange (as before) made every bucket wait for every gradient."""
    from models import create_model
    split_after = [10, 20]
    ir_dir = tmp_path / "ir"
    run_msdist("train", tiny_args(data_dir, tmp_path / "out", "--max_steps", 1, "--loss_scale", "dynamic",
                                  "--allreduce_fusion", ",".join(map(str, split_after))), ranks=2,
               env={"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "hwopt_common_final",
                    "MS_DEV_SAVE_GRAPHS_PATH": str(ir_dir)})
    net = create_model("resnet_tiny", 4)
    params = net.trainable_params()
    plan = buckets.cut_after(buckets.parameter_sizes(net), split_after)
    convs_by_size = {len(b.names): sum(params[i].ndim == 4 for i in range(b.first, b.last + 1)) for b in plan}
    assert len(convs_by_size) == len(plan)  # the bucket sizes tell the fused ops apart
    [graph] = [g for g in glob.glob(os.path.join(ir_dir, "rank_0", "hwopt_common_final_graph_*.ir"))
               if "AllReduce(" in open(g, encoding="utf-8").read()]
    nodes = _kernel_graph_nodes(graph)
    reduces = [n for n, (op, _, _) in nodes.items() if op == "AllReduce"]
    assert sorted(len(nodes[n][1]) for n in reduces) == sorted(convs_by_size), "one fused AllReduce per bucket"
    seen_filters = set()
    for node in reduces:
        before = _ancestors(nodes, node)
        filters = {a for a in before if nodes[a][0] == "Conv2DBackpropFilter"}
        assert len(filters) == convs_by_size[len(nodes[node][1])], \
            f"the bucket of {len(nodes[node][1])} gradients waits for {len(filters)} weight gradients"
        assert not [a for a in before if nodes[a][0] in ("AllReduce", "AllGather")]
        assert not filters & seen_filters
        seen_filters |= filters
