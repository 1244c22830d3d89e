"""Gradient buckets (#32 item 4, msdist/engine/buckets.py, step.bucket_gradients): contiguous in network
order, cut by bytes, sent last layers first; and, in the step MindSpore compiles for `--loss_scale dynamic`
on 2 real ranks, each bucket is one AllReduce op and none depends on a gradient outside its bucket (read from
the saved IR)."""
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


def test_the_fusion_threshold_lies_past_the_largest_bucket_in_mindspores_256_kb_units():
    # 3 MB is 12 units of 262144 bytes: 13 leaves the bucket whole. ResNet-18's largest auto bucket at 4 classes
    # (24.1 MB, 96.4 units): 98.
    from models import create_model
    plan = buckets.cut_after([("a", 2 * MB), ("b", 3 * MB)], [0])
    assert buckets.fusion_config(plan) == 13
    sizes = buckets.parameter_sizes(create_model("resnet18", 4))
    assert buckets.fusion_config(buckets.plan_buckets(sizes)) == 98


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


def _saved_allreduces(data_dir, tmp_path, *args) -> tuple:
    """The final kernel graph MindSpore saves (save_graphs) of rank 0 in a 1-step 2-rank CPU run: (nodes, AllReduce
    node ids)."""
    ir_dir = tmp_path / "ir"
    run_msdist("train", tiny_args(data_dir, tmp_path / "out", "--max_steps", 1, *args), ranks=2,
               env={"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "hwopt_common_final",
                    "MS_DEV_SAVE_GRAPHS_PATH": str(ir_dir)})
    [graph] = [g for g in glob.glob(os.path.join(ir_dir, "rank_0", "hwopt_common_final_graph_*.ir"))
               if "AllReduce(" in open(g, encoding="utf-8").read()]
    nodes = _kernel_graph_nodes(graph)
    return nodes, [n for n, (op, _, _) in nodes.items() if op == "AllReduce"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resnet18s_auto_buckets_compile_to_one_allreduce_each(data_dir, tmp_path):
    """ResNet-18's two auto buckets (25 MB and 19.7 MB): with the threshold counted in MB, MindSpore cut them
    into six ops of at most 6.5 MB."""
    from models import create_model
    plan = buckets.plan_buckets(buckets.parameter_sizes(create_model("resnet18", 4)))
    nodes, reduces = _saved_allreduces(data_dir, tmp_path, "--model", "resnet18", "--image_size", 32,
                                       "--allreduce_fusion", "auto")
    assert sorted(len(nodes[n][1]) for n in reduces) == sorted(len(b.names) for b in plan)


@pytest.mark.multiprocess
def test_no_bucket_all_reduce_waits_for_gradients_outside_it_with_a_dynamic_scale(data_dir, tmp_path):
    """The IR MindSpore saves (save_graphs) of a 2-rank CPU run, `--loss_scale dynamic`, three buckets of
    resnet_tiny: each fused AllReduce reads the weight gradients (Conv2DBackpropFilter) of its own bucket's
    convolutions only, and no other collective comes before it. An overflow flag all-reduced before the
    exchange (as before) made every bucket wait for every gradient."""
    from models import create_model
    split_after = [10, 20]
    nodes, reduces = _saved_allreduces(data_dir, tmp_path, "--loss_scale", "dynamic", "--allreduce_fusion",
                                       ",".join(map(str, split_after)))
    net = create_model("resnet_tiny", 4)
    params = net.trainable_params()
    plan = buckets.cut_after(buckets.parameter_sizes(net), split_after)
    convs_by_size = {len(b.names): sum(params[i].ndim == 4 for i in range(b.first, b.last + 1)) for b in plan}
    assert len(convs_by_size) == len(plan)  # the bucket sizes tell the fused ops apart
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
