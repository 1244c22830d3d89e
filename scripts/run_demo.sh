#!/usr/bin/env bash
# The built-in demo: synthesize a fruit-like ImageFolder tree (no download), then train a ResNet-18 on it
# with 2 data-parallel mpirun processes. About 3 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/synth}
[ -d "$DATA/Training" ] || python3 -m msdist.data synth "$DATA" --classes 4 --per_class 150
exec bash scripts/run_distribute_train.sh 2 --config configs/demo_synth.yaml --data_dir "$DATA" "$@"
