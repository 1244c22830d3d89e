#!/usr/bin/env bash
# Single-card baseline: bash scripts/run_standalone_train.sh --config configs/resnet50_fruits360.yaml --data_dir DIR
exec "${PYTHON:-python3}" -m msdist.train "$@"
