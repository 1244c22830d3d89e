"""MindSpore's device calls in a fresh process: `set_device` is the call whose device id communication init
keeps, and msdist's distributed init makes it."""
import subprocess
import sys

from conftest import REPO, base_env


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=300, check=True)
    return proc.stdout.strip().splitlines()[-1]


def test_set_device_is_the_only_device_id_communication_init_keeps():
    """mindspore/device_manager.py `set_device`: DeviceManagerConf.set_device(target, id, is_default) enables
    the id that communication init keeps; context.py `set_context(device_id=...)` (deprecated for
    'api mindspore.set_device()' in `_check_context_deprecated`) writes only the old context field."""
    probe = ("import mindspore as ms; from mindspore._c_expression import DeviceManagerConf as C; {call}; "
             "conf = C.get_instance(); print(conf.is_device_enable(), tuple(ms.get_current_device()))")
    assert _run(probe.format(call="ms.set_context(device_target='CPU', device_id=1)")) == "False ('CPU', 0)"
    assert _run(probe.format(call="ms.set_device('CPU', 1)")) == "True ('CPU', 1)"


def test_distributed_init_sets_the_device_through_set_device():
    """msdist.cluster.distributed.init calls mindspore.set_device (mindspore/device_manager.py `set_device`)."""
    code = ("from msdist.base import launch_env; from msdist.cluster import distributed; distributed.init(launch_env.detect_launch({}), 'CPU', ''); "
            "from mindspore._c_expression import DeviceManagerConf as C; print(C.get_instance().is_device_enable())")
    assert _run(code) == "True"
