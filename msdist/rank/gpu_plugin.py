"""Would MindSpore's GPU plugin load on this host? MindSpore 2.10's own rules, applied to files. MindSpore-free.

`msdist.check --plan` (and every start-up, before MindSpore loads) used to call a GPU usable when the
wheel shipped a plugin file. MindSpore loads one only under these rules (the loader is C++ in the 2.10
wheel's lib/libmindspore_hardware_abstract.so, built from mindspore-ai/mindspore
mindspore/ccsrc/runtime/hardware/device_context_manager.cc, read at commit 017aef80; the wheel's
library carries the same messages, e.g. "can not find nvcc file", "can not find suitable gpu plugin"):

* `DeviceContextManager::LoadPlugin` groups lib/plugin/libmindspore_*.so.* by name. For the GPU
  plugin with CUDA_HOME set and more than one version shipped it calls `SelectGpuPlugin`; otherwise it
  tries the versions newest first (the file names in reverse order) and keeps the first that loads.
* `SelectGpuPlugin` needs CUDA_HOME/bin/nvcc (`GetNvccRealPath`: without it, "can not find nvcc
  file" and NO plugin loads), reads "Cuda compilation tools, release X.Y," from `nvcc --version`
  (`GetCudaVersionFromNvcc`), and takes the plugin of exactly X.Y, else the one of the same major
  whose `VersionToFloat` lies just below X.Y; none fitting: "can not find suitable gpu plugin".
* A plugin loads (`TestLoadDynamicLib`: dlopen in a forked child) only when the dynamic linker finds
  every library it needs: for libmindspore_gpu.so.11.x the CUDA 11 runtime (libcudart.so.11.0),
  cuDNN 8 (libcudnn.so.8), cuBLAS/cuFFT/cuRAND/cuSOLVER/cuSPARSE, NVRTC and the driver's libcuda.so.1
  (`readelf -d lib/plugin/libmindspore_gpu.so.11.6`); the NCCL backend's libnvidia_collective.so
  (lib/plugin/gpu11.x) needs NCCL 2 (libnccl.so.2).

Here the libraries are looked up where the dynamic linker looks (the plugin's RPATH and the Python
executable's, LD_LIBRARY_PATH, /etc/ld.so.cache, ld.so.conf's folders, the default folders) under a
host root, so a copy of a GPU node's files can be judged from elsewhere (`--host_root`). What files
cannot show (a library of the wrong build, a driver too old for the runtime) stays "unverified" until
MindSpore loads the plugin.
"""
import glob
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

GPU_PLUGIN = "libmindspore_gpu"
_NVCC_RELEASE = re.compile(r"Cuda compilation tools, release (\d+)\.(\d+),")
# The libraries of the CUDA stack a plugin needs, named for the message; the rest (libc, libstdc++, MindSpore's
# own libraries in the wheel) are any Linux host's or the wheel's.
_CUDA_STACK = re.compile(r"^lib(cuda|cudart|cudnn|cublas|cublasLt|cufft|curand|cusolver|cusparse|nvrtc|nccl)\.so")
_LABELS = {"libcudart": "the CUDA {} runtime", "libcudnn": "cuDNN {}", "libnccl": "NCCL {}",
           "libcuda": "the NVIDIA driver's CUDA library"}
_DEFAULT_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
_DT_NEEDED, _DT_RPATH, _DT_RUNPATH, _SHT_DYNAMIC = 1, 15, 29, 6


@dataclass(frozen=True)
class PluginVerdict:
    loads: bool          # False: MindSpore would load no GPU plugin (`problem` says why)
    plugin: str = ""     # the plugin file MindSpore would load
    problem: str = ""    # the missing piece, one line
    unverified: str = "" # what files cannot show

    def describe(self) -> str:
        if not self.loads:
            return f"will not load: {self.problem}"
        return f"{os.path.basename(self.plugin)} ({self.unverified})"


def plugin_version(path: str) -> Optional[Tuple[int, int]]:
    """(major, minor) from a plugin file name's last two dot-separated fields, as `GetVersionFromFileName`."""
    match = re.search(r"\.(\d+)\.(\d+)$", path)
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_to_float(major: int, minor: int) -> float:
    """MindSpore's `VersionToFloat`, kept as written (minor / (digits + 1), not / 10**digits): the order it gives
    is the order `SelectGpuPlugin` compares."""
    return major + minor / (len(str(minor)) + 1)


def select_by_cuda_version(files: Sequence[str], major: int, minor: int) -> str:
    """`SelectGpuPlugin`'s choice among `files` (sorted as MindSpore's std::set holds them) for CUDA major.minor."""
    versions = [(path, plugin_version(path)) for path in sorted(files)]
    versions = [(path, v) for path, v in versions if v is not None]
    for path, version in versions:
        if version == (major, minor):
            return path
    chosen, target = "", version_to_float(major, minor)
    for i, (path, (plugin_major, plugin_minor)) in enumerate(versions):
        if plugin_major != major:
            continue
        below = target > version_to_float(plugin_major, plugin_minor)
        next_above = i + 1 >= len(versions) or target < version_to_float(*versions[i + 1][1])
        if below and next_above:
            chosen = path
    return chosen


def candidates(files: Sequence[str], cuda_home: str, nvcc_release: Optional[Tuple[int, int]],
               nvcc_exists: bool) -> Tuple[List[str], str]:
    """The plugin files MindSpore tries, in order, and why none when the list is empty. Pure.

    Args:
        files: the wheel's libmindspore_gpu.so.* files.
        cuda_home: the CUDA_HOME variable ("" = unset).
        nvcc_release: what CUDA_HOME/bin/nvcc --version reports, None when it could not be read.
        nvcc_exists: CUDA_HOME/bin/nvcc exists.
    """
    if not files:
        return [], "this MindSpore wheel ships no GPU plugin"
    if not cuda_home or len(files) <= 1:
        return sorted(files, reverse=True), ""
    shipped = ", ".join(".".join(map(str, plugin_version(f) or ())) for f in sorted(files))
    if not nvcc_exists:
        return [], (f"CUDA_HOME={cuda_home} has no bin/nvcc, and with {len(files)} GPU plugins ({shipped}) MindSpore "
                    "then loads none (it picks one by nvcc's CUDA version); point CUDA_HOME at a CUDA toolkit with "
                    "nvcc, or unset it")
    if nvcc_release is None:
        return [], f"{cuda_home}/bin/nvcc --version gave no CUDA release, so MindSpore loads no GPU plugin"
    chosen = select_by_cuda_version(files, *nvcc_release)
    if not chosen:
        return [], (f"CUDA_HOME's nvcc is CUDA {nvcc_release[0]}.{nvcc_release[1]} and no GPU plugin of this wheel "
                    f"({shipped}) fits it, so MindSpore loads none; point CUDA_HOME at a CUDA {shipped} toolkit, or "
                    "unset it")
    return [chosen], ""


def elf_dynamic(path: str, tags: Tuple[int, ...] = (_DT_RPATH, _DT_RUNPATH)) -> Tuple[List[str], List[str]]:
    """(DT_NEEDED names, the folders of its `tags` entries: RPATH and RUNPATH) of a 64-bit little-endian ELF file."""
    with open(path, "rb") as f:
        data = f.read(64)
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        f.seek(shoff)
        sections = [struct.unpack("<IIQQQQIIQQ", f.read(shentsize)[:64]) for _ in range(shnum)]
        dynamic = next(s for s in sections if s[1] == _SHT_DYNAMIC)
        f.seek(dynamic[4])
        raw = f.read(dynamic[5])
        strtab = sections[dynamic[6]]
        f.seek(strtab[4])
        strings = f.read(strtab[5])
    entries = [struct.unpack_from("<qQ", raw, i) for i in range(0, len(raw), 16)]

    def text(offset):
        return strings[offset:strings.index(b"\0", offset)].decode()
    needed = [text(v) for tag, v in entries if tag == _DT_NEEDED]
    paths = [p for tag, v in entries if tag in tags for p in text(v).split(":") if p]
    return needed, paths


def _ld_conf_dirs(root: str) -> List[str]:
    """The folders /etc/ld.so.conf names (and its include files), which ldconfig caches."""
    found, pending = [], [os.path.join(root, "etc", "ld.so.conf")]
    while pending:
        try:
            with open(pending.pop(), encoding="utf-8", errors="replace") as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
        except OSError:
            continue
        for line in filter(None, lines):
            if line.startswith("include "):
                pending += sorted(glob.glob(os.path.join(root, line.split(None, 1)[1].lstrip("/"))))
            else:
                found.append(line)
    return found


def _executable_rpath() -> List[str]:
    """This Python's own DT_RPATH folders (a conda Python's $ORIGIN/../lib), which glibc searches for the
    dependencies of every library it loads (a DT_RUNPATH would serve the executable's own only)."""
    executable = os.path.realpath(sys.executable)
    try:
        _, rpath = elf_dynamic(executable, (_DT_RPATH,))
    except (OSError, ValueError, StopIteration, struct.error):
        return []
    return [p.replace("$ORIGIN", os.path.dirname(executable)) for p in rpath]


def search_dirs(rpath: Sequence[str], origin: str, root: str, env: Mapping[str, str]) -> List[str]:
    """Where the dynamic linker looks for a library's dependencies, in its order, under `root` (the cache aside).

    $ORIGIN folders are the wheel's (this machine's); the others are the host's, read under `root`. On this
    host (root "/") the running Python's RPATH counts too.
    """
    def on_host(folder):
        return os.path.join(root, folder.lstrip("/"))
    dirs = [p.replace("$ORIGIN", origin) if "$ORIGIN" in p else on_host(p) for p in rpath]
    dirs += _executable_rpath() if os.path.realpath(root) == "/" else []
    dirs += [on_host(p) for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    return dirs + [on_host(p) for p in _ld_conf_dirs(root) + list(_DEFAULT_DIRS)]


def _in_ld_cache(name: str, root: str) -> bool:
    """Whether /etc/ld.so.cache (ldconfig's, which the linker consults before the default folders) lists `name`:
    its string table holds each cached library's full path, so "/<name>" followed by NUL appears."""
    try:
        with open(os.path.join(root, "etc", "ld.so.cache"), "rb") as f:
            return b"/" + name.encode() + b"\0" in f.read()
    except OSError:
        return False


def findable(name: str, root: str, env: Mapping[str, str]) -> bool:
    """Whether the dynamic linker would find library `name` by itself (no RPATH): its cache or its folders."""
    dirs = search_dirs((), "", root, env)
    return _in_ld_cache(name, root) or any(os.path.exists(os.path.join(d, name)) for d in dirs)


def findable_here(name: str) -> bool:
    """`findable` on this host, in this process's environment (the profiler's CUPTI check)."""
    return findable(name, "/", os.environ)


def is_cuda_stack(name: str) -> bool:
    """A library of the CUDA stack (driver, runtime, cuDNN, NCCL...), which a host must provide."""
    return bool(_CUDA_STACK.match(name))


def missing_libraries(library: str, root: str, env: Mapping[str, str]) -> List[str]:
    """The CUDA-stack libraries `library` needs that the dynamic linker would not find under `root`."""
    needed, rpath = elf_dynamic(library)
    dirs = search_dirs(rpath, os.path.dirname(library), root, env)
    return [name for name in needed if is_cuda_stack(name) and not _in_ld_cache(name, root) and
            not any(os.path.exists(os.path.join(d, name)) for d in dirs)]


def label(name: str) -> str:
    """`libcudnn.so.8` -> "libcudnn.so.8 (cuDNN 8)"."""
    stem, _, version = name.partition(".so.")
    template = _LABELS.get(stem)
    return f"{name} ({template.format(version.split('.')[0])})" if template else name


def nvcc_release(cuda_home: str, root: str) -> Tuple[bool, Optional[Tuple[int, int]]]:
    """(CUDA_HOME/bin/nvcc exists, the release its --version prints or None), as MindSpore runs it."""
    nvcc = os.path.join(root, cuda_home.lstrip("/"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        return False, None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return True, None
    match = _NVCC_RELEASE.search(out)
    return True, (int(match.group(1)), int(match.group(2))) if match else None


def verdict(plugin_dir: str, root: str, env: Mapping[str, str]) -> PluginVerdict:
    """Whether MindSpore would load a GPU plugin from `plugin_dir` on the host under `root`, and which."""
    files = sorted(glob.glob(os.path.join(plugin_dir, f"{GPU_PLUGIN}.so.*")))
    cuda_home = env.get("CUDA_HOME", "")
    exists, release = nvcc_release(cuda_home, root) if cuda_home and len(files) > 1 else (False, None)
    tried, why_none = candidates(files, cuda_home, release, exists)
    if not tried:
        return PluginVerdict(False, problem=why_none)
    first_missing = []
    for plugin in tried:
        missing = missing_libraries(plugin, root, env)
        version = ".".join(map(str, plugin_version(plugin) or ()))
        collective = os.path.join(plugin_dir, f"gpu{version}", "libnvidia_collective.so")
        if not missing and os.path.exists(collective):
            missing = missing_libraries(collective, root, env)
        if not missing:
            return PluginVerdict(True, plugin, unverified="its CUDA, cuDNN and NCCL libraries are present; whether "
                                                          "they load (builds, driver version) is unverified until "
                                                          "MindSpore loads it")
        first_missing = first_missing or [(plugin, missing)]
    plugin, missing = first_missing[0]
    return PluginVerdict(False, problem=f"{os.path.basename(plugin)} needs {', '.join(map(label, missing))}, found "
                                        "in none of its RPATH, LD_LIBRARY_PATH, ld.so.cache, ld.so.conf or default "
                                        "library folders")
