"""Will the MindSpore 2.10 wheel's GPU kernels run on this GPU as shipped, or be compiled at the first start?
Pure decisions (compute capability in, advice out) plus one nvidia-smi query. MindSpore-free.

What the wheel carries, read from the `.nv_fatbin` section of lib/plugin/gpu/libcuda_ops.so.11 (the GPU plugin's
kernels; every one of its 407 fatbins lists the same targets): machine code (SASS) for sm_60, sm_61, sm_70, sm_75
and sm_80, and PTX for compute_60 and compute_86. CUDA runs SASS built for X.y on any X.z with z >= y (binary
compatibility within a major version), so 8.6 and 8.9 (A10, L4, RTX 30/40) run the sm_80 code as shipped. A newer
major (9.0: H100, H200) has no SASS: the driver compiles the compute_86 PTX when the kernels load, at the first
start of every fresh container unless its JIT cache survives: CUDA_CACHE_PATH on a persistent volume (the default,
~/.nv/ComputeCache, dies with the container) and CUDA_CACHE_MAXSIZE large enough to keep it (about 150 MiB of
sm_80 SASS here, before cuDNN's and cuBLAS's own; the driver's default size may evict part of it). CUDA 11.8's
runtime libraries carry sm_90 code of their own, so only MindSpore's kernels are compiled.
"""
import re
import subprocess
from typing import List, Mapping, Tuple

WHEEL_SASS = ((6, 0), (6, 1), (7, 0), (7, 5), (8, 0))
WHEEL_PTX = ((6, 0), (8, 6))
CACHE_MAXSIZE = 4 * 2**30   # CUDA's upper bound for CUDA_CACHE_MAXSIZE (4 GiB)
_CAP = re.compile(r"^\s*(\d+)\.(\d+)\s*$")


def runs_as_shipped(capability: Tuple[int, int]) -> bool:
    """The wheel has machine code this GPU runs: SASS of the same major and a minor not above its own."""
    return any(major == capability[0] and minor <= capability[1] for major, minor in WHEEL_SASS)


def jit_compiles(capability: Tuple[int, int]) -> bool:
    """No machine code for this GPU, but PTX the driver can compile for it (PTX of an older target or its own)."""
    return not runs_as_shipped(capability) and any(ptx <= capability for ptx in WHEEL_PTX)


def kernel_advice(capabilities: List[Tuple[int, int]], env: Mapping[str, str], cache_dir: str) -> str:
    """The `--plan` line on the wheel's kernels for these GPUs (compute capabilities; [] = unknown).

    Args:
        env: the rank's environment (CUDA_CACHE_PATH, CUDA_CACHE_MAXSIZE, CUDA_CACHE_DISABLE as set).
        cache_dir: a folder on the run's persistent storage to suggest for CUDA_CACHE_PATH.
    """
    if not capabilities:
        return ("compute capability unknown (nvidia-smi gave none); the wheel has machine code up to sm_80 and "
                "PTX for compute_86: a GPU of compute capability 9.0 or newer compiles the kernels at the first start")
    names = ", ".join(f"{major}.{minor}" for major, minor in sorted(set(capabilities)))
    too_old = [c for c in capabilities if not runs_as_shipped(c) and not jit_compiles(c)]
    if too_old:
        return (f"compute capability {names}: MindSpore 2.10's GPU kernels need 6.0 or newer (sm_60 is the oldest "
                "code the wheel carries); use a newer GPU or --device_target CPU")
    if not any(jit_compiles(c) for c in capabilities):
        return f"compute capability {names}: the wheel's machine code (sm_60-sm_80) runs as shipped, no JIT compile"
    return (f"compute capability {names}: the wheel has machine code up to sm_80 only, so at its first start the "
            "driver compiles MindSpore's kernels from their compute_86 PTX (it can take many minutes); "
            + _cache_advice(env, cache_dir))


def _cache_advice(env: Mapping[str, str], cache_dir: str) -> str:
    if env.get("CUDA_CACHE_DISABLE") == "1":
        return "CUDA_CACHE_DISABLE=1 throws the result away, so every start compiles again: unset it"
    path, size = env.get("CUDA_CACHE_PATH", ""), env.get("CUDA_CACHE_MAXSIZE", "")
    if path and size.isdigit() and int(size) >= CACHE_MAXSIZE:
        return (f"the JIT cache (CUDA_CACHE_PATH={path}, CUDA_CACHE_MAXSIZE={size}) makes it a one-time cost if "
                "that folder is on a persistent volume")
    return (f"make it a one-time cost: CUDA_CACHE_PATH={path or cache_dir} on a persistent volume, "
            f"CUDA_CACHE_MAXSIZE={CACHE_MAXSIZE} (now {'CUDA_CACHE_MAXSIZE=' + size if size else 'the default'})")


def parse_compute_caps(text: str) -> List[Tuple[int, int]]:
    """`nvidia-smi --query-gpu=compute_cap --format=csv,noheader` output: one "X.Y" per GPU."""
    return [(int(m.group(1)), int(m.group(2))) for m in map(_CAP.match, text.splitlines()) if m]


def query_compute_caps() -> List[Tuple[int, int]]:
    """This host's GPUs' compute capabilities from nvidia-smi; [] without one (or a driver too old to say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_compute_caps(out.stdout) if out.returncode == 0 else []
