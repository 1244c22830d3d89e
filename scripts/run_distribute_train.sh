#!/usr/bin/env bash
# Data-parallel training on N processes of this host (or the hosts in your MPI hostfile).
#   GPU host (N GPUs): bash scripts/run_distribute_train.sh N --config configs/resnet50_fruits360_gpu.yaml --data_dir DIR
#   CPU host:          bash scripts/run_distribute_train.sh N --config configs/resnet50_fruits360.yaml --data_dir DIR
#   [--key value ...] after them overrides the config. The CPU recipe's global batch of 32 leaves 4 images per GPU
#   on 8 GPUs, too few for BatchNorm: training warns at start-up (so does msdist.check --plan).
# Launchers: mpirun (default; OpenMPI from the OS: apt-get install openmpi-bin), or LAUNCHER=msdist for
# msdist's own launcher (no OpenMPI needed; fail-fast, restarts with --max_restarts K), or LAUNCHER=msrun
# for MindSpore's msrun (MASTER_PORT, default 8118; its logs in MSRUN_LOG_DIR, default msrun_logs).
# Cost (2-core AMD EPYC, CPU): ResNet-50 100x100 ~18 img/s for the job; see docs/performance.md (every run: benchmarks/results/throughput.md).
set -euo pipefail
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N --config CONFIG --data_dir DIR [train args...]   (N = number of processes; on GPUs" \
       "CONFIG = configs/resnet50_fruits360_gpu.yaml)" >&2
  exit 2
fi
N=$1; shift
PYTHON=${PYTHON:-python3}
if [ "${LAUNCHER:-mpirun}" = "msdist" ]; then
  exec "$PYTHON" -m msdist.launch -n "$N" "$@"
fi
if [ "${LAUNCHER:-mpirun}" = "msrun" ]; then
  # MindSpore's own launcher; its scheduler is this same command with MS_ROLE=MS_SCHED (msdist serves it).
  exec msrun --worker_num "$N" --local_worker_num "$N" --master_port "${MASTER_PORT:-8118}" --join True \
    --log_dir "${MSRUN_LOG_DIR:-msrun_logs}" "$PYTHON" -m msdist.train "$@"
fi
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
  echo "error: $MPIRUN not found. Install OpenMPI (sudo apt-get install -y openmpi-bin) or run without it:" \
       "LAUNCHER=msdist $0 $N $*" >&2
  exit 127
fi
# OpenMPI refuses root (containers, CI) unless told; more ranks than cores needs --oversubscribe.
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
EXTRA=()
if [ "$N" -gt "$(nproc)" ]; then EXTRA+=(--oversubscribe); fi
exec "$MPIRUN" -n "$N" "${EXTRA[@]}" "$PYTHON" -m msdist.train "$@"
