"""`python -m msdist.launch -n N [launcher options] [train options]`: start and supervise a job.

Every option the launcher does not know goes to msdist.train; the launcher reads the stall options
(`--stall_*`, msdist.cluster.stall) from those train options too. The command line is parsed and checked
here, once, before any rank starts, into a `Command`; msdist.launcher.supervisor runs its `Plan` (spawn,
watch, stop, restart).
"""
import argparse
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional

from msdist.base.args import ArgumentParser
from msdist.base.cli import cli_main
from msdist.base.errors import ConfigError
from msdist.cluster import preemption
from msdist.cluster.stall import StallPolicy
from msdist.launcher import elastic, peers, restarts
from msdist.launcher.membership import parse_nnodes
from msdist.launcher.supervisor import Plan, run, worker_env
from msdist.run import config, startup


_MIN_MEMBERSHIP_TIMEOUT_S = 4 * peers.POLL_S   # a few polls may be missed before a node counts as lost


@dataclass(frozen=True)
class Command:
    """One msdist.launch command line, parsed once."""
    plan: Plan                     # what the supervisor runs on this node
    train: argparse.Namespace      # the ranks' train config, parsed from plan.train_args
    show_plan: bool                # --plan: print each local rank's `msdist.check --plan` and start nothing
    limits: elastic.Limits         # --nnodes MIN:MAX: --membership_timeout, --max_reforms
    host_root: str                 # --plan's --host_root: where the GPU facts are read


def _build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="msdist.launch", allow_abbrev=False,
                description="Start N ranks of msdist.train on this node; unknown options go to msdist.train.")
    p.add_argument("-n", "--nproc_per_node", type=int, required=True, help="ranks (worker processes) on this node")
    p.add_argument("--nnodes", default="1", help="number of nodes, each running one launcher: M, or MIN:MAX for "
                   "an elastic job that goes on while at least MIN nodes are left and admits nodes up to MAX [1]")
    p.add_argument("--node_rank", type=int, default=0, help="this node's index, 0..nnodes-1; node 0 hosts the "
                   "scheduler (elastic: node 0 forms the job, the others join it, in this order) [0]")
    p.add_argument("--master_addr", default="", help="address or host name of node 0 (resolved once, here); "
                   "required with --nnodes > 1 (elastic: any node of the running job) [127.0.0.1 on a single node]")
    p.add_argument("--wait_for_nodes", type=float, default=30.0, help="--nnodes MIN:MAX: once MIN nodes have "
                   "joined, node 0 waits this long for more, up to MAX, before the job starts [30]")
    limits = elastic.Limits()
    p.add_argument("--membership_timeout", type=float, default=limits.membership_timeout, help="--nnodes MIN:MAX: "
                   "a node whose launcher has not answered for this long is lost (the others re-form without it); a "
                   "member that answers but has not stopped its ranks within twice this is left out "
                   f"[{limits.membership_timeout:g}]")
    p.add_argument("--max_reforms", type=int, default=limits.max_reforms, help="--nnodes MIN:MAX: re-form the job "
                   "after a lost or failed node at most this many times (a node joining does not count), then fail: "
                   f"a flapping host or link cannot take the job back to its checkpoint forever [{limits.max_reforms}]")
    p.add_argument("--master_port", type=int, default=0, help="scheduler port on node 0; required with --nnodes > 1 "
                   "[a free port]")
    p.add_argument("--max_restarts", type=int, default=0, help="restart all ranks with --resume auto after a "
                   "failure, up to this many times [0]")
    p.add_argument("--plan", action="store_true", help="print what each local rank would do (python -m msdist.check "
                   "--plan with that rank's variables) and start nothing")
    p.add_argument("--host_root", default="/", help="with --plan: read the GPU facts (/dev/nvidia*, /proc/driver/"
                   "nvidia) under this root [/]")
    return p


def read_command(argv: Optional[List[str]] = None) -> Command:
    """Split launcher options from train options and check both (paths aside) before anything starts.

    Raises:
        ConfigError: a bad launcher option, or a train config that msdist.train would reject.
    """
    parser = _build_parser()
    ns, train_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    train_args = config.renamed_to_current(train_args)  # the ranks get the current names: one notice, here
    if ns.nproc_per_node < 1:
        raise ConfigError(f"-n {ns.nproc_per_node}: need at least one rank per node")
    nodes = parse_nnodes(ns.nnodes)
    if not 0 <= ns.node_rank < nodes.max:
        raise ConfigError(f"--node_rank {ns.node_rank} must be in 0..{nodes.max - 1} (--nnodes {ns.nnodes})")
    if nodes.max > 1 and not (ns.master_addr and ns.master_port):
        raise ConfigError("--nnodes > 1 needs --master_addr (node 0's address reachable from every node) and "
                          "--master_port, the same on every node")
    if not 0 <= ns.master_port < 65535:  # elastic: --master_port + 1 is the membership service's
        raise ConfigError(f"--master_port {ns.master_port} is not a TCP port")
    if ns.max_restarts < 0:
        raise ConfigError(f"--max_restarts {ns.max_restarts} must be >= 0")
    # Fail here, once, rather than in N ranks; a mistyped launcher option gets its did-you-mean too.
    launcher_options = [o[2:] for o in parser._option_string_actions if o.startswith("--")]  # pylint: disable=protected-access
    cfg = config.parse(train_args, suggest_also=launcher_options)
    if ns.wait_for_nodes < 0:
        raise ConfigError(f"--wait_for_nodes {ns.wait_for_nodes} must be >= 0")
    if ns.membership_timeout < _MIN_MEMBERSHIP_TIMEOUT_S:
        raise ConfigError(f"--membership_timeout {ns.membership_timeout:g} must be >= {_MIN_MEMBERSHIP_TIMEOUT_S:g} "
                          f"s (launchers exchange their state every {peers.POLL_S:g} s)")
    if ns.max_reforms < 0:
        raise ConfigError(f"--max_reforms {ns.max_reforms} must be >= 0")
    # The batch is cut for MAX nodes' ranks whatever the world size (MSDIST_BATCH_SLOTS): checked for those.
    startup.run_checks(cfg, ns.nproc_per_node * nodes.max, startup.OPTION_CHECKS)
    plan = Plan(nproc=ns.nproc_per_node, nnodes=nodes.min, max_nodes=nodes.max, node_rank=ns.node_rank,
                master_addr=ns.master_addr or "127.0.0.1", master_port=ns.master_port,
                wait_for_nodes=ns.wait_for_nodes, max_restarts=ns.max_restarts,
                stall=StallPolicy.from_options(vars(cfg)), preempt_signal=preemption.parse_signal(cfg.preempt_signal),
                train_args=list(train_args), output_dir=os.path.abspath(cfg.output_dir))
    limits = elastic.Limits(membership_timeout=ns.membership_timeout, max_reforms=ns.max_reforms)
    return Command(plan=plan, train=cfg, show_plan=ns.plan, host_root=ns.host_root, limits=limits)


def parse_args(argv: Optional[List[str]] = None) -> Plan:
    """The supervisor's plan of a command line (`read_command`)."""
    return read_command(argv).plan


def show_plan(plan: Plan, host_root: str) -> int:
    """`msdist.launch --plan`: run `msdist.check --plan` for each local rank, with the variables that rank
    would get (port 0: the one picked at start); start nothing. Returns the worst exit status."""
    codes = [subprocess.run([sys.executable, "-m", "msdist.check", "--plan", "--host_root", host_root,
                             *plan.train_args], check=False,
                            env=dict(os.environ, **worker_env(plan, i, plan.master_addr, plan.master_port)),
                            stdin=subprocess.DEVNULL).returncode for i in range(plan.nproc)]
    return max(codes)


@cli_main
def main(argv: Optional[List[str]] = None) -> int:
    command = read_command(argv)
    plan = command.plan
    if command.show_plan:
        return show_plan(plan, command.host_root)
    # Paths are this node's: named once here, before any rank starts, not by every rank after start-up.
    startup.run_checks(command.train, plan.world_size, startup.PATH_CHECKS)
    if plan.max_nodes > plan.nnodes:
        return run(plan, functools.partial(elastic.supervise, limits=command.limits))
    return run(plan, restarts.supervise)


if __name__ == "__main__":
    raise SystemExit(main())
