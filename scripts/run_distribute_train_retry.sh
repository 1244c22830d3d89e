#!/usr/bin/env bash
# mpirun with restarts: after a failed job, run it again with --resume auto, up to MAX_RESTARTS times.
#   MAX_RESTARTS=3 bash scripts/run_distribute_train_retry.sh N --config CONFIG --data_dir DIR [--key value ...]
#   GPU host: --config configs/resnet50_fruits360_gpu.yaml; CPU host: --config configs/resnet50_fruits360.yaml
# Under mpirun a rank that dies (kill -9, exception) ends the whole job, including the MindSpore
# scheduler rank 0 started, so each retry starts clean. `--resume auto` makes every rank resume from
# the newest checkpoint all ranks have and whose sha256 verifies (a corrupt newest one is skipped),
# so a finished run matches an uninterrupted one. Without OpenMPI the launcher does the same itself:
#   LAUNCHER=msdist bash scripts/run_distribute_train.sh N --max_restarts 3 ...
# Cost: each retry pays start-up again (~10-20 s on CPU) plus the steps since the last checkpoint.
set -uo pipefail
MAX_RESTARTS=${MAX_RESTARTS:-3}
TRAIN="$(dirname "$0")/run_distribute_train.sh"

bash "$TRAIN" "$@"
status=$?
for ((restart = 1; restart <= MAX_RESTARTS && status != 0; restart++)); do
  if [ "$status" -eq 2 ]; then
    break  # msdist: error: a bad option, config or data; running again cannot fix it
  fi
  echo "run_distribute_train_retry: job failed (exit $status); restart $restart of $MAX_RESTARTS with --resume auto" >&2
  bash "$TRAIN" "$@" --resume auto
  status=$?
done
if [ "$status" -ne 0 ]; then
  echo "run_distribute_train_retry: FAILED (exit $status)" >&2
fi
exit "$status"
