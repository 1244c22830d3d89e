#!/usr/bin/env bash
# 8-process data-parallel training: bash scripts/run_distribute_train_8p.sh --config CONFIG --data_dir DIR [...]
#   GPU host: --config configs/resnet50_fruits360_gpu.yaml; CPU host: --config configs/resnet50_fruits360.yaml
exec bash "$(dirname "$0")/run_distribute_train.sh" 8 "$@"
