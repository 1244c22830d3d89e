"""MindSpore loads late: a fresh interpreter imports the whole launcher and runs a rank's start-up up to the
join (parse, checks, device decision, runtime environment), and MindSpore is still not loaded. The import
contract in .importlinter says the same of the launcher's source; this checks what Python really loads,
lazy imports and third-party packages included."""
import json
import subprocess
import sys

from conftest import REAL_DATA, REPO, base_env, tiny_args

_CHILD = """
import importlib, json, pkgutil, sys
import msdist.launcher, msdist.launch
launcher = sorted(m.name for m in pkgutil.iter_modules(msdist.launcher.__path__, "msdist.launcher."))
for name in launcher:
    importlib.import_module(name)
loaded = {"launcher": launcher, "after_launcher": "mindspore" in sys.modules}
import msdist.train
from msdist.run import run_plan, startup
started = startup.start(sys.argv[1:], resolve=run_plan.resolve)  # what msdist.train's main does first
loaded["after_startup"] = "mindspore" in sys.modules
loaded["device"] = started.device.target
print(json.dumps(loaded))
"""


def test_the_launcher_and_a_ranks_start_up_never_load_mindspore(tmp_path):
    env = dict(base_env(), ONEDNN_MAX_CPU_ISA="AVX2")  # the ISA named: no probe (it loads MindSpore in its own process)
    for launcher_var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "MS_ROLE", "RANK"):
        env.pop(launcher_var, None)
    args = tiny_args(REAL_DATA, tmp_path / "run", "--device_target", "CPU")
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"msdist.launcher.supervisor", "msdist.launcher.elastic", "msdist.launcher.relay"} <= set(loaded["launcher"])
    assert (loaded["after_launcher"], loaded["after_startup"], loaded["device"]) == (False, False, "CPU")
