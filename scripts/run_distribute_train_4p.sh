#!/usr/bin/env bash
# 4-process data-parallel training: bash scripts/run_distribute_train_4p.sh --config CONFIG --data_dir DIR [...]
#   GPU host: --config configs/resnet50_fruits360_gpu.yaml; CPU host: --config configs/resnet50_fruits360.yaml
exec bash "$(dirname "$0")/run_distribute_train.sh" 4 "$@"
