#!/usr/bin/env bash
# Evaluate a checkpoint on Test/: bash scripts/run_eval.sh [N] --config CONFIG --data_dir DIR --ckpt PATH
# With N > 1 the Test set is sharded over N mpirun processes and the counts are summed (same result).
set -euo pipefail
N=1
if [[ "${1:-}" =~ ^[1-9][0-9]*$ ]]; then N=$1; shift; fi
PYTHON=${PYTHON:-python3}
if [ "$N" -eq 1 ]; then exec "$PYTHON" -m msdist.eval "$@"; fi
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
  echo "error: $MPIRUN not found. Install OpenMPI (sudo apt-get install -y openmpi-bin) or evaluate with N=1" >&2
  exit 127
fi
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
exec "$MPIRUN" -n "$N" --oversubscribe "$PYTHON" -m msdist.eval "$@"
