"""`python -m msdist.check` (standalone or under mpirun / msdist.launch): is the environment sane?

Every rank AllGathers its rank id and prints what it received, with device target, backend and
versions: the tutorial's first test, with a verdict.
"""
import os
import platform
import tempfile
import sys

from msdist import distributed, runtime
from msdist.errors import cli_main


@cli_main
def main(argv=None) -> int:
    launch = distributed.detect_launch()
    rt = runtime.prepare(verbose=False, cpu_isa="auto", local_world_size=launch.local_world_size)
    import mindspore as ms
    import numpy as np

    # The scheduler log (mpirun on CPU) goes to the temp dir: a check must not litter the working directory.
    dist = distributed.init(launch, "auto", os.path.join(tempfile.gettempdir(), "msdist-check"), deterministic=False)
    received = distributed.Collectives(dist.world_size).gather([float(dist.rank)])[:, 0].astype(int).tolist()
    ok = received == list(range(dist.world_size))
    print(f"rank {dist.rank}/{dist.world_size}: all_gather(rank) -> {received} [{'ok' if ok else 'MISMATCH'}] | "
          f"device {dist.device_target} | backend {dist.backend or 'none (standalone)'} | launch {launch.kind} | "
          f"mindspore {ms.__version__} | numpy {np.__version__} | python {platform.python_version()} | "
          f"oneDNN ISA {rt.cpu_isa} | threads/rank {rt.threads_per_rank}", flush=True)
    return runtime.exit_without_teardown(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
