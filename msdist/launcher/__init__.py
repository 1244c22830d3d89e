"""The control plane, a program of its own: what runs in `python -m msdist.launch`, the elastic agent and the
relay, never inside a rank. MindSpore-free by contract (.importlinter) and by a fresh-interpreter test
(tests/unit/launcher/test_mindspore_free.py); it imports msdist.cluster and msdist.base only.

- supervisor: spawn, watch and stop this node's ranks, one attempt at a time (`Plan`, `run`, `worker_env`)
- restarts: a fixed job's restart policy across attempts (`--max_restarts`)
- failures: how a failed attempt is described (rank, how, where, traceback tail, first cause)
- elastic: `--nnodes MIN:MAX`'s loop: first formation, re-forming after a loss, admission
- membership: the elastic decision, pure: who is in, who hosts the scheduler, which node ranks
- drain: after a stop signal's save, a drain (the signalled nodes leave) told apart from a stop of the whole job
- claims: each membership claimed once in the shared log dir, by an exclusive create the file server decides
- peers: each launcher's small TCP service on `--master_port + 1`, the nodes' states exchanged
- scheduler_generation: node 0's token for each scheduler it starts, so no node rejoins a dying one, and its
  final outcome, so a node restarting after node 0 ended ends at once
- forwarder: the preemption signal passed on to the ranks this launcher started, once
- relay: `python -m msdist.launcher.relay -- CMD`, a pod's PID 1 passing the preemption signal on
"""
