"""The shared layer above msdist.base that both programs read, the launcher (msdist.launcher) and the ranks
(msdist.rank): MindSpore-free at import. Nothing here imports from msdist.launcher, msdist.rank or above.

- job: what each kind of launch needs before MindSpore loads (backend, mpirun bridge, MS_* variables)
- rendezvous: how the ranks meet: addresses, ports, the scheduler's start, the rendezvous file, timeouts
- scheduler: `python -m msdist.cluster.scheduler`, MindSpore's scheduler tied to the life of its job
- registration: who has registered with the scheduler, read from its log, and the line naming a rank that has not
- stall: the one `StallPolicy` and its `--stall_*` option family
- phases: `Phase`, what a rank's main thread is doing: written into its heartbeat, read by the stall policy
- heartbeat: each rank's progress file, its format and reader, and the stall verdict read from all of them
- preemption: SIGTERM always and `--preempt_signal`, the signals a scheduler may send, `REQUEUE_EXIT`
- announce: the pid files ranks announce themselves with, by which the relay finds them, and their exit status
"""
