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
# Exit 42: a rank never registered with MindSpore's scheduler (docs/launch.md, "A rank that has not joined
# the cluster"); nothing ran yet, so up to MAX_START_RETRIES such starts are not counted as restarts.
# Exit 200 is a preemption, not a failure: every rank saved at one agreed step; this script does not
# retry in place (the allocation is going away) but exits 200 for the cluster to requeue the job.
set -uo pipefail
MAX_RESTARTS=${MAX_RESTARTS:-3}
MAX_START_RETRIES=${MAX_START_RETRIES:-3}
NOT_REGISTERED_EXIT=42   # msdist.cluster.registration.NOT_REGISTERED_EXIT
REQUEUE_EXIT=200   # msdist.cluster.preemption.REQUEUE_EXIT
TRAIN="$(dirname "$0")/run_distribute_train.sh"

bash "$TRAIN" "$@"
status=$?
start_retries=0
for ((restart = 1; restart <= MAX_RESTARTS && status != 0; restart++)); do
  if [ "$status" -eq 2 ] || [ "$status" -eq "$REQUEUE_EXIT" ]; then
    break  # a bad option, config or data (running again cannot fix it), or a preemption (requeue instead)
  fi
  if [ "$status" -eq "$NOT_REGISTERED_EXIT" ] && [ "$start_retries" -lt "$MAX_START_RETRIES" ]; then
    start_retries=$((start_retries + 1))
    restart=$((restart - 1))
    echo "run_distribute_train_retry: a rank never registered with the scheduler (exit $status); starting again" \
      "($start_retries of $MAX_START_RETRIES)" >&2
  else
    echo "run_distribute_train_retry: job failed (exit $status); restart $restart of $MAX_RESTARTS with --resume auto" >&2
  fi
  bash "$TRAIN" "$@" --resume auto
  status=$?
done
if [ "$status" -eq "$REQUEUE_EXIT" ]; then
  echo "run_distribute_train_retry: preempted (exit $status): every rank saved; requeue the job" >&2
elif [ "$status" -ne 0 ]; then
  echo "run_distribute_train_retry: FAILED (exit $status)" >&2
fi
exit "$status"
