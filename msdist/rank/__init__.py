"""What runs inside a rank (msdist.train, eval, the tools): MindSpore-free at import, MindSpore loaded only
when a function that needs it is called. It imports msdist.cluster and msdist.base only, never
msdist.launcher.

- runtime: what must happen before `import mindspore` (ISA, threads, core binding, compile cache) and the end
- isa_probe: `python -m msdist.rank.isa_probe`, the oneDNN ISA caps this CPU runs, probed and cached
- local_exchange: what the ranks of one host tell each other before any collective exists
- device: each rank's device and device id, decided from the host's files before MindSpore loads
- gpu_plugin: whether MindSpore 2.10 would load its GPU plugin on this host
- distributed: distributed init (mpirun bridge, dynamic cluster, NCCL), `Collectives`, the MPI finish
- heartbeat_writer: this rank's heartbeat file, written from a daemon thread, and its stacks on demand
- watchdog: the in-rank thread that acts on the stall verdict under mpirun, msrun and srun
- preempt_stop: the preemption signal heard on its own thread (`Listener`), the step all ranks stop at (`Agreement`)
"""
