"""The restart policy of a fixed job (`python -m msdist.launch` without --nnodes MIN:MAX): attempts
(msdist.launcher.supervisor.run_attempt) until one succeeds, `--max_restarts` is spent or the job is preempted.

On several nodes each launcher restarts its own ranks, and the other nodes join node 0's next scheduler
(msdist.launcher.scheduler_generation); node 0 leaves its final outcome there too, so that a node restarting
after node 0 ended ends at once with node 0's verdict.
"""
import os
import time

from msdist.base.errors import ConfigError
from msdist.cluster import preemption, rendezvous
from msdist.launcher import scheduler_generation
from msdist.launcher.forwarder import Forwarder
from msdist.launcher.supervisor import Plan, Stopped, report_failure, run_attempt, say


def supervise(plan: Plan, forwarder: Forwarder) -> int:
    """Run attempts until one succeeds, the restart budget is spent or the job is preempted; the exit status.
    Node 0 of several leaves its outcome where restarting nodes look for its next scheduler."""
    code = 1
    try:
        code = _attempts(plan, forwarder)
        return code
    except scheduler_generation.NodeZeroEnded as ended:
        say(str(ended))
        return 0 if ended.code == 0 else 1
    except Stopped as stop:
        code = 128 + stop.signum
        raise
    finally:
        if plan.node_rank == 0 and plan.nnodes > 1:
            scheduler_generation.mark_ended(plan.log_dir, code)


def _attempts(plan: Plan, forwarder: Forwarder) -> int:
    os.makedirs(plan.log_dir, exist_ok=True)
    if plan.node_rank == 0 and plan.master_port and rendezvous.port_in_use(plan.master_addr, plan.master_port):
        raise ConfigError(f"--master_port {plan.master_port} is already in use on {plan.master_addr}; "
                          "choose another port or omit --master_port to pick a free one")
    train_args = plan.train_args
    joined = {}
    for attempt in range(plan.max_restarts + 1):
        if attempt:
            train_args = plan.train_args + ["--resume", "auto"]
            say(f"restart {attempt} of {plan.max_restarts}: starting the ranks again with --resume auto")
        began = time.monotonic()
        failure = run_attempt(plan, train_args, attempt, joined, forwarder)
        if failure is None:
            say(f"all ranks finished in {time.monotonic() - began:.0f} s")
            return 0
        if failure.requeue:
            say(failure.summary())
            return preemption.REQUEUE_EXIT
        report_failure(failure, time.monotonic() - failure.seen_at, plan.log_dir)
        if failure.user_error:
            # Running again cannot fix it, and --resume auto could even hide it (e.g. an output_dir
            # that holds another run's checkpoints).
            say("not restarting: fix the error above first")
            return 1
        if forwarder.requested_at is not None:  # a restart would resume where a requeue does
            say(f"not restarting: the job is being preempted; it continues from the newest complete checkpoint "
                f"(exit {preemption.REQUEUE_EXIT})")
            return preemption.REQUEUE_EXIT
    spent = f" after {plan.max_restarts} restart(s)" if plan.max_restarts else ""
    # MindSpore ends ranks whose peer on another node vanished (~30 s), so the cause may be elsewhere.
    elsewhere = "; with several nodes the first failure may be on another node: see its launcher" \
        if plan.nnodes > 1 else ""
    say(f"FAILED{spent}: {failure.summary()}{elsewhere}")
    return 1
