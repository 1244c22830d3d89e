"""Would MindSpore 2.10 load its GPU plugin? msdist/rank/gpu_plugin.py applies MindSpore's loader rules
(device_context_manager.cc `LoadPlugin`, `SelectGpuPlugin`, `TestLoadDynamicLib`) to fake host roots built under
tmp_path, with the installed wheel's real plugin files (their ELF headers name what they need)."""
import os
import stat

import pytest

from conftest import REAL_DATA, REPO, base_env, cuda_libraries, fake_gpu_node
from msdist.rank import device, gpu_plugin

WHEEL_PLUGINS = device.wheel_plugin_dir()
PLUGINS = sorted(n for n in os.listdir(WHEEL_PLUGINS) if n.startswith("libmindspore_gpu.so."))
NEWEST = PLUGINS[-1]
P = [f"/w/plugin/libmindspore_gpu.so.{v}" for v in ("11.1", "11.6")]


@pytest.mark.parametrize("cuda, chosen", [
    ((11, 6), P[1]), ((11, 1), P[0]),          # exact
    ((11, 8), P[1]), ((11, 4), P[0]),          # same major, the plugin just below
    ((11, 0), ""), ((12, 2), ""), ((10, 2), ""),  # below every plugin, another major: "can not find suitable"
])
def test_select_by_cuda_version_as_select_gpu_plugin(cuda, chosen):
    assert gpu_plugin.select_by_cuda_version(P, *cuda) == chosen


def test_version_to_float_is_mindsporess_own():
    """VersionToFloat divides the minor by its digit count + 1 (11.6 -> 14.0, 11.10 -> 14.33), kept as written."""
    assert gpu_plugin.version_to_float(11, 6) == 14.0 and round(gpu_plugin.version_to_float(11, 10), 2) == 14.33


@pytest.mark.parametrize("files, cuda_home, release, nvcc, tried, why", [
    (P, "", None, False, [P[1], P[0]], ""),                        # no CUDA_HOME: newest first, first that loads
    ([P[0]], "/usr/local/cuda", None, False, [P[0]], ""),          # one plugin: CUDA_HOME is not consulted
    (P, "/usr/local/cuda", (11, 6), True, [P[1]], ""),             # CUDA_HOME + nvcc: only the one that fits
    (P, "/opt/cuda-runtime", None, False, [], "has no bin/nvcc"),  # CUDA_HOME without nvcc: none at all
    (P, "/usr/local/cuda", None, True, [], "gave no CUDA release"),
    (P, "/usr/local/cuda", (12, 2), True, [], "no GPU plugin of this wheel (11.1, 11.6) fits it"),
    ([], "", None, False, [], "ships no GPU plugin"),
])
def test_candidates_follow_load_plugin(files, cuda_home, release, nvcc, tried, why):
    found, reason = gpu_plugin.candidates(files, cuda_home, release, nvcc)
    assert found == tried and (why in reason if why else reason == "")


def test_the_wheels_plugins_need_cuda_11_cudnn_8_and_nccl_2():
    needed = cuda_libraries(WHEEL_PLUGINS)
    assert {"libcudart.so.11.0", "libcudnn.so.8", "libcuda.so.1", "libnccl.so.2"} <= set(needed)


def _verdict(root, **env):
    return gpu_plugin.verdict(WHEEL_PLUGINS, str(root), env)


def test_a_node_with_cuda_11_and_cudnn_8_loads_the_newest_plugin_and_the_rest_is_unverified(tmp_path):
    result = _verdict(fake_gpu_node(tmp_path, 4))
    assert result.loads and os.path.basename(result.plugin) == NEWEST
    assert result.describe().startswith(f"{NEWEST} (") and "unverified" in result.describe()


def _remove(root, name):
    for folder, _, files in os.walk(root):
        if name in files:
            os.remove(os.path.join(folder, name))


@pytest.mark.parametrize("name, piece", [
    ("libcudnn.so.8", "libcudnn.so.8 (cuDNN 8)"),
    ("libcudart.so.11.0", "libcudart.so.11.0 (the CUDA 11 runtime)"),
    ("libcuda.so.1", "libcuda.so.1 (the NVIDIA driver's CUDA library)"),
])
def test_the_missing_piece_is_named(tmp_path, name, piece):
    root = fake_gpu_node(tmp_path, 4)
    _remove(root, name)
    result = _verdict(root)
    assert not result.loads and result.problem == f"{NEWEST} needs {piece}, found in none of its RPATH, " \
                                                  "LD_LIBRARY_PATH, ld.so.cache, ld.so.conf or default library folders"


def _move_cuda(root, folder):
    """Move /usr/local/cuda/lib64's libraries (found through the plugin's RPATH) to `folder` under root."""
    source = os.path.join(root, "usr", "local", "cuda", "lib64")
    os.makedirs(os.path.join(root, folder.lstrip("/")))
    for name in os.listdir(source):
        os.rename(os.path.join(source, name), os.path.join(root, folder.lstrip("/"), name))


def test_libraries_are_found_where_the_dynamic_linker_looks(tmp_path):
    root = fake_gpu_node(tmp_path, 1)
    _move_cuda(root, "/opt/cudnn/lib")
    assert "libcudnn.so.8" in _verdict(root).problem                      # not in any folder the linker searches
    assert _verdict(root, LD_LIBRARY_PATH="/opt/other:/opt/cudnn/lib").loads
    conf = os.path.join(root, "etc", "ld.so.conf.d")
    os.makedirs(conf)
    with open(os.path.join(root, "etc", "ld.so.conf"), "w", encoding="utf-8") as f:
        f.write("include /etc/ld.so.conf.d/*.conf\n")
    with open(os.path.join(conf, "cuda.conf"), "w", encoding="utf-8") as f:
        f.write("# written by the CUDA installer\n/opt/cudnn/lib\n")
    assert _verdict(root).loads                                           # ldconfig's folders
    os.remove(os.path.join(conf, "cuda.conf"))
    cached = os.listdir(os.path.join(root, "opt", "cudnn", "lib"))
    with open(os.path.join(root, "etc", "ld.so.cache"), "wb") as f:     # ldconfig's cache: full paths, NUL-ended
        f.write(b"glibc-ld.so.cache1.1" + b"".join(f"/opt/cudnn/lib/{n}".encode() + bytes(1) for n in cached))
    assert _verdict(root).loads


def _nvcc(root, release):
    """CUDA_HOME=/usr/local/cuda with an nvcc that prints this release, as NVIDIA's does."""
    path = os.path.join(root, "usr", "local", "cuda", "bin", "nvcc")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                f"echo 'Cuda compilation tools, release {release}, V{release}.99'\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.mark.skipif(len(PLUGINS) < 2, reason="the installed wheel ships one GPU plugin: CUDA_HOME is not consulted")
def test_cuda_home_picks_the_plugin_by_nvccs_version(tmp_path):
    root = fake_gpu_node(tmp_path, 4)  # the newest plugin's libraries only
    no_nvcc = _verdict(root, CUDA_HOME="/usr/local/cuda")
    assert not no_nvcc.loads and no_nvcc.problem.startswith("CUDA_HOME=/usr/local/cuda has no bin/nvcc, and with 2 GPU "
                                                            "plugins (11.1, 11.6) MindSpore then loads none")
    _nvcc(root, NEWEST.rsplit(".so.", 1)[1])
    assert os.path.basename(_verdict(root, CUDA_HOME="/usr/local/cuda").plugin) == NEWEST
    _nvcc(root, "11.4")  # -> the 11.1 plugin, whose NVRTC this node lacks
    older = _verdict(root, CUDA_HOME="/usr/local/cuda")
    assert not older.loads and older.problem.startswith(f"{PLUGINS[0]} needs libnvrtc.so.11.1"), older.problem
    _nvcc(root, "12.2")
    assert "nvcc is CUDA 12.2 and no GPU plugin of this wheel" in _verdict(root, CUDA_HOME="/usr/local/cuda").problem


def test_the_nccl_backend_needs_nccl_2(tmp_path):
    """A plugin folder whose gpu11.x holds libnvidia_collective.so but no libnccl.so.2 (the wheel ships one)."""
    plugins = tmp_path / "plugin"
    version = NEWEST.rsplit(".so.", 1)[1]
    (plugins / f"gpu{version}").mkdir(parents=True)
    os.symlink(os.path.join(WHEEL_PLUGINS, NEWEST), plugins / NEWEST)
    os.symlink(os.path.join(WHEEL_PLUGINS, f"gpu{version}", "libnvidia_collective.so"),
               plugins / f"gpu{version}" / "libnvidia_collective.so")
    result = gpu_plugin.verdict(str(plugins), fake_gpu_node(tmp_path / "root", 1), {})
    assert not result.loads and "libnccl.so.2 (NCCL 2)" in result.problem


def test_plan_names_the_missing_piece_in_one_line(tmp_path):
    import subprocess
    import sys
    root = fake_gpu_node(tmp_path, 1)
    _remove(root, "libcudnn.so.8")
    env = {k: v for k, v in base_env().items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "MS_", "CUDA_"))}
    proc = subprocess.run([sys.executable, "-m", "msdist.check", "--plan", "--config", f"{REPO}/configs/tiny_test.yaml",
                           "--data_dir", REAL_DATA, "--host_root", root], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout.strip()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("msdist: error: --device_target auto on a host with NVIDIA hardware, but MindSpore's GPU "
                           f"plugin did not load: {NEWEST} needs libcudnn.so.8 (cuDNN 8), found in none"), line
    cpu = subprocess.run([sys.executable, "-m", "msdist.check", "--plan", "--config", f"{REPO}/configs/tiny_test.yaml",
                          "--data_dir", REAL_DATA, "--host_root", root, "--device_target", "CPU"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert f"[rank 0] gpu plugin: will not load: {NEWEST} needs libcudnn.so.8" in cpu.stdout
