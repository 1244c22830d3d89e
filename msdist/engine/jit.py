"""MindSpore's compile level for the train step (`--jit_level`): a pure decision, no MindSpore here.

MindSpore 2.10 knows two levels for a graph run by its own backend (mindspore/graph/jit_config.py:45-52,
mindspore/graph/api.py:1204-1210):
- O0: only the optimizations correctness needs, kernel by kernel. The default of `mindspore.jit`.
- O1: common optimizations plus automatic operator fusion (the graph-kernel fusion that
  `set_context(enable_graph_kernel=True)` used to switch on; 2.10 deprecates that in favour of jit_level O1,
  mindspore/context.py:1581-1584), still kernel by kernel. MindSpore calls it experimental (graph/api.py:1209).

`auto` (the default) is O1 on GPU and O0 on CPU:
- GPU: a step launches each per-parameter element-wise kernel on its own (unscale, overflow check, update mask,
  casts: about 5 per parameter, 161 parameters for ResNet-50), each a few microseconds of launch for
  microseconds of work; fusing them is what MindSpore's graph-kernel fusion is for (its guide lists GPU among
  the platforms, and AKG, its kernel compiler, ships in the GPU wheel).
- CPU: O1 measured no faster than O0 on this host (benchmarks/step_ab.py jit_level, docs/performance.md "Compile
  level"), and O0 is `mindspore.jit`'s own default (graph/api.py:1206).
"""
from msdist.base.errors import ConfigError

JIT_LEVELS = ("auto", "O0", "O1")


def resolve_jit_level(jit_level: str, device_target: str) -> str:
    """The compile level a run uses: `auto` is O1 on GPU and O0 elsewhere; an explicit level is kept.

    Raises:
        ConfigError: a level MindSpore 2.10 does not run on its own backend.
    """
    if jit_level not in JIT_LEVELS:
        raise ConfigError(f"--jit_level {jit_level!r} is not one of {', '.join(JIT_LEVELS)}")
    if jit_level != "auto":
        return jit_level
    return "O1" if device_target == "GPU" else "O0"
