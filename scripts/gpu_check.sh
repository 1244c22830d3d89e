#!/usr/bin/env bash
# The first GPU node's acceptance run (docs/cluster.md, "GPU acceptance run"): 1 GPU and every local GPU, each with
# --sink_size 1 and the default, a few hundred steps; prints img/s, the weights' agreement, the host's share of a
# step and whether the all-reduce overlapped the backward, and writes OUT/gpu_bench.json. On a CPU host it runs the
# same on CPU and says so.
#   bash scripts/gpu_check.sh --data_dir DIR --output_dir OUT [--steps 300] [msdist.train options...]
set -euo pipefail
exec python3 -m msdist.check --gpu_bench "$@"
