"""`python -m msdist.check` (standalone or under mpirun / msdist.launch): is the environment sane?

Every rank AllGathers its rank id and prints what it received, with device target, backend and
versions: the tutorial's first test, with a verdict.
"""
import os
import platform
import tempfile
import sys

from msdist import config, runtime, startup
from msdist.errors import cli_main

CHECK_OPTIONS = [o for o in config.TRAIN_OPTIONS if o.name in ("device_target", "cpu_isa", "bind_cores", "verbose")]


@cli_main
def main(argv=None) -> int:
    started = startup.start(argv, options=CHECK_OPTIONS, prog="msdist.check", checks=())
    # The scheduler log (mpirun on CPU) goes to the temp dir: a check must not litter the working directory.
    dist, collectives = startup.join(started, os.path.join(tempfile.gettempdir(), "msdist-check"),
                                     log_name="check")
    import mindspore as ms
    import numpy as np

    rt, launch = started.rt, started.launch
    received = collectives.gather([float(dist.rank)])[:, 0].astype(int).tolist()
    ok = received == list(range(dist.world_size))
    print(f"rank {dist.rank}/{dist.world_size}: all_gather(rank) -> {received} [{'ok' if ok else 'MISMATCH'}] | "
          f"device {dist.device_target} | backend {dist.backend or 'none (standalone)'} | launch {launch.kind} | "
          f"mindspore {ms.__version__} | numpy {np.__version__} | python {platform.python_version()} | "
          f"oneDNN ISA {rt.cpu_isa} | threads/rank {rt.threads_per_rank}", flush=True)
    return runtime.exit_without_teardown(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
