"""`python -m msdist.plan_scale --config C [--key value ...] (--gpu NAME | --step_ms MS) [--json]`

Before renting GPUs: msdist's step time, exposed gradient exchange, images/s, scaling efficiency and input
cores per GPU for N = 1, 2, 4, ..., 1024, with float32, fp16 and top-K gradients, and the first N where the
exchange dominates. The model and every constant: docs/scaling.md (`run/forecast.py`, `run/hardware.py`);
the buckets are the training step's own (`run/network_cost.py`). Nothing is trained; the network is built
on CPU once.
"""
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError
from msdist.engine import precision
from msdist.rank import runtime
from msdist.run import config, forecast, hardware, network_cost, startup
from msdist.run.forecast import Compute, Network

JSON_FLAG = "--json"  # a bare flag, like msdist.check's --plan
OPTIONS = config.TRAIN_OPTIONS + [
    config.Option("step_ms", float, 0.0, "measured step time of one GPU at the config's batch_size (" +
                  hardware.STEP_MS_HOWTO + "); wins over --gpu", min=0, hashed=False),
    config.Option("gpu", str, "", f"GPU from the compute table ({', '.join(hardware.GPUS)}), ResNet-18/50/101 at "
                  "224 px scaled to image_size", hashed=False),
    config.Option("network", str, "", "link presets, inside a node and/or between nodes, comma-separated: "
                  f"{', '.join(hardware.INTRA_LINKS)}; {', '.join(hardware.INTER_LINKS)} (default: the GPU's usual "
                  f"link inside, {hardware.DEFAULT_INTER} between)", hashed=False),
    config.Option("intra_busbw", float, None, "all-reduce bus bandwidth inside a node, GB/s (wins over --network)",
                  above=0, hashed=False),
    config.Option("inter_busbw", float, None, "all-reduce bus bandwidth of a node's network link, GB/s (wins over "
                  "--network)", above=0, hashed=False),
    config.Option("latency_us", float, None, "fixed cost of one collective on either level, us (wins over "
                  "--network)", min=0, hashed=False),
    config.Option("gpus_per_node", int, 8, "GPUs per node; beyond it NCCL's ring crosses the nodes' links", min=1,
                  hashed=False),
    config.Option("max_nodes", int, 0, "an elastic job (msdist.launch --nnodes MIN:MAX): its MAX; below MAX nodes "
                  "each GPU trains several batch slots as micro-batches, with no overlap; 0 = not elastic", min=0,
                  hashed=False),
    config.Option("per_gpu_batch", int, 0, "forecast weak scaling with this batch per GPU; 0 keeps the config's "
                  "global batch_size (strong scaling)", min=0, hashed=False),
    config.Option("input_us", float, 0.0, "CPU microseconds per image of your input pipeline (`python -m "
                  "msdist.data bench DIR`); 0 = msdist's measured figure at image_size", min=0, hashed=False),
]
IMAGENET_CLASSES = 1000


@dataclass(frozen=True)
class Setup:
    """The options resolved: what one GPU computes and where it sends, in the forecast's own terms."""
    compute: Compute
    compute_source: str
    network: Network
    input_us: float
    num_classes: int


@cli_main
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = JSON_FLAG in argv
    cfg = config.parse([a for a in argv if a != JSON_FLAG], options=OPTIONS, prog="msdist.plan_scale")
    setup = resolve(cfg)
    # One forward pass on CPU: oneDNN's own ISA choice is fast enough, no probe.
    startup.start_standalone(device_target="CPU", cpu_isa="default")
    grads = network_cost.network_gradients(cfg.model, setup.num_classes, cfg.image_size, cfg.allreduce_fusion)
    max_gpus = cfg.max_nodes * cfg.gpus_per_node
    tables = {exchange: forecast.forecast(exchange, grads, setup.compute, setup.network, cfg.batch_size,
                                          cfg.per_gpu_batch or None, setup.input_us, cfg.topk_ratio,
                                          max_gpus=max_gpus)
              for exchange in forecast.EXCHANGES}
    report = as_report(cfg, setup, grads, tables)
    print(json.dumps(report, indent=1) if as_json else render(report))
    return 0


def _precision(cfg) -> str:
    return hardware.precision_of(precision.resolve_amp_level(cfg.amp_level, "GPU"))


def _compute(cfg) -> Tuple[Compute, str]:
    """One GPU's compute per image and where it comes from: the measured --step_ms (the sink-mode step's host
    terms taken out, added back per step), else the table scaled to image_size by pixels."""
    host = dict(host_ms=hardware.SINK_STEP_HOST_MS, accum_steps=cfg.grad_accum_steps, sync_bn=cfg.sync_bn,
                call_ms=hardware.HOST_OVERHEAD_MS)
    if cfg.step_ms:
        per_image = max(cfg.step_ms - hardware.SINK_STEP_HOST_MS, 0.0) / cfg.batch_size
        source = f"measured: --step_ms {cfg.step_ms:g} at batch {cfg.batch_size} on one GPU"
        return Compute(per_image, **host), source
    if not cfg.gpu:
        raise ConfigError(f"say what one GPU computes: --gpu NAME ({', '.join(hardware.GPUS)}) or "
                          f"{hardware.STEP_MS_HOWTO}")
    kind = _precision(cfg)
    rate = hardware.gpu_throughput(cfg.gpu, cfg.model, kind)
    per_image = hardware.ms_per_image(cfg.gpu, cfg.model, kind, cfg.image_size)
    source = (f"{cfg.gpu.upper()} {kind}: {rate.images_per_sec:.0f} img/s at 224 px, batch {rate.batch} "
              f"({rate.source}), scaled to {cfg.image_size} px")
    return Compute(per_image, **host), source


def _edited(link: hardware.Link, busbw: Optional[float], latency_us: Optional[float]) -> hardware.Link:
    """`link` with the command line's --*_busbw / --latency_us in place of the preset's figures."""
    if busbw is None and latency_us is None:
        return link
    return hardware.Link(f"{link.name} (edited)", link.busbw_gbs if busbw is None else busbw,
                         link.latency_us if latency_us is None else latency_us, "command line")


def _network(cfg) -> Network:
    intra, inter = hardware.links(cfg.network, cfg.gpu)
    return Network(_edited(intra, cfg.intra_busbw, cfg.latency_us), _edited(inter, cfg.inter_busbw, cfg.latency_us),
                   cfg.gpus_per_node)


def _num_classes(cfg) -> int:
    """The config's, else Training/'s class folders, else ImageNet's 1000 (the classifier's size only)."""
    train = os.path.join(cfg.data_dir, "Training") if cfg.data_dir else ""
    if cfg.num_classes or not os.path.isdir(train):
        return cfg.num_classes or IMAGENET_CLASSES
    return sum(1 for e in os.scandir(train) if e.is_dir()) or IMAGENET_CLASSES


def resolve(cfg) -> Setup:
    """Check and resolve every option before MindSpore loads. Raises ConfigError naming the fix."""
    startup.check_model(cfg, 1)
    compute, source = _compute(cfg)
    input_us = cfg.input_us or hardware.input_us_per_image(cfg.image_size)
    return Setup(compute, source, _network(cfg), input_us, _num_classes(cfg))


def as_report(cfg, setup: Setup, grads, tables: Dict[str, forecast.Forecast]) -> dict:
    """Everything the forecast rests on and its rows: the --json document, and what `render` prints."""
    net = setup.network
    return {
        "model": cfg.model, "image_size": cfg.image_size, "num_classes": setup.num_classes,
        "scaling": "weak" if cfg.per_gpu_batch else "strong",
        "batch": ({"per_gpu": cfg.per_gpu_batch} if cfg.per_gpu_batch else {"global": cfg.batch_size}),
        "compute": {"ms_per_image": setup.compute.ms_per_image, "host_ms_per_step": setup.compute.host_ms,
                    "python_ms_per_call": setup.compute.call_ms, "grad_accum_steps": setup.compute.accum_steps,
                    "sync_bn": setup.compute.sync_bn, "max_nodes": cfg.max_nodes, "source": setup.compute_source},
        "first_start": hardware.FIRST_START.get(cfg.gpu.upper(), ""),
        "network": {"gpus_per_node": net.gpus_per_node, "intra": asdict(net.intra), "inter": asdict(net.inter)},
        "input_us_per_image": setup.input_us,
        "gradients": {"tensors": len(grads.sizes), "bytes": sum(n for _, n in grads.sizes),
                      "allreduce_fusion": cfg.allreduce_fusion,
                      "buckets": [{"bytes": b.nbytes, "first": b.names[0], "last": b.names[-1]}
                                  for b in grads.buckets]},
        "configured_exchange": "topk" if cfg.grad_compression in ("topk", "threshold") else cfg.grad_compression,
        "topk_ratio": cfg.topk_ratio,
        "forecasts": {name: {"first_dominated_gpus": table.first_dominated(), "rows": [asdict(r) for r in table.rows]}
                      for name, table in tables.items()},
    }


TITLES = {"none": "float32 all-reduce (grad_compression none)", "fp16": "fp16 all-reduce (grad_compression fp16)",
          "topk": "top-K AllGather (grad_compression topk / threshold, topk_ratio {ratio})"}


def _link_text(link: dict) -> str:
    return f"{link['name']} {link['busbw_gbs']:.1f} GB/s, {link['latency_us']:g} us"


def _overlap_text(compute: dict) -> str:
    """What stops backward from hiding the exchange (`forecast.overlaps_backward`); each row's overlap column."""
    causes = [f"none with grad_accum_steps {compute['grad_accum_steps']} (reduced after all micro-batches)"
              ] if compute["grad_accum_steps"] > 1 else []
    causes += ["none with sync_bn (its collectives queue behind the buckets)"] if compute["sync_bn"] else []
    causes += [f"none below max_nodes {compute['max_nodes']} (several batch slots per GPU, reduced after all of "
               "them)"] if compute["max_nodes"] else []
    return "overlap of exchange and backward: " + ("; ".join(causes) or "each bucket leaves once backward made it")


def render(report: dict) -> str:
    """The report as text: what it rests on, then one table per gradient exchange."""
    grads, net = report["gradients"], report["network"]
    batch = (f"weak scaling: {report['batch']['per_gpu']} images per GPU at every N" if report["scaling"] == "weak"
             else f"strong scaling: global batch {report['batch']['global']} kept, split over N GPUs "
                  "(--per_gpu_batch P forecasts weak scaling)")
    sends = ", ".join(f"{b['bytes'] / 2**20:.1f} MB ({b['first']} .. {b['last']})" for b in grads["buckets"])
    lines = [f"msdist.plan_scale: {report['model']} at {report['image_size']} px, {report['num_classes']} classes",
             f"compute: {report['compute']['ms_per_image']:.3f} ms per image on one GPU ({report['compute']['source']})",
             f"host, sink mode: {report['compute']['host_ms_per_step']:g} ms per step (MindSpore's end-of-step stream "
             f"sync and next launch) + {report['compute']['python_ms_per_call']:g} ms of Python per chunk of steps",
             _overlap_text(report["compute"]),
             batch,
             f"network: {net['gpus_per_node']} GPUs per node; inside {_link_text(net['intra'])}; between nodes "
             f"{_link_text(net['inter'])}",
             f"gradients: {grads['tensors']} tensors, {grads['bytes'] / 2**20:.1f} MB float32, "
             f"allreduce_fusion {grads['allreduce_fusion']!r}, {len(grads['buckets'])} bucket(s) in send order: "
             f"{sends}; one AllReduce op each",
             f"input: {report['input_us_per_image']:.0f} us CPU per image (msdist.data bench; --input_us for yours)"]
    if report["first_start"]:
        lines.append(f"first start: {report['first_start']}")
    for name, table in report["forecasts"].items():
        mark = "  <- this config" if name == report["configured_exchange"] else ""
        lines += ["", f"== {TITLES[name].format(ratio=report['topk_ratio'])}{mark}",
                  f"{'N':>5} {'nodes':>5} {'batch/GPU':>9} {'compute ms':>10} {'exposed ms':>10} {'host ms':>7} "
                  f"{'step ms':>9} {'img/s':>10} {'eff':>6} {'input cores/GPU':>15} {'overlap':>7}"]
        for r in table["rows"]:
            lines.append(f"{r['gpus']:>5} {r['nodes']:>5} {r['per_gpu_batch']:>9.4g} {r['compute_ms']:>10.2f} "
                         f"{r['exposed_ms']:>10.2f} {r['host_ms']:>7.3f} {r['step_ms']:>9.2f} "
                         f"{r['images_per_sec']:>10.0f} {r['efficiency']:>6.1%} {r['input_cores_per_gpu']:>15.2f} "
                         f"{'yes' if r['overlapped'] else 'no':>7}")
        first = table["first_dominated_gpus"]
        last = table["rows"][-1]["gpus"] if table["rows"] else 1
        lines.append(f"communication dominates (exposed exchange >= compute) from N = {first}" if first else
                     f"communication does not dominate up to N = {last}")
    return "\n".join(lines)


if __name__ == "__main__":
    runtime.end_process(main)
