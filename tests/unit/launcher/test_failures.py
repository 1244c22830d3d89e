"""msdist.launcher.failures: the crash line names the rank and skips MindSpore's rulers."""
from msdist.base import launch_env
from msdist.cluster import rendezvous
from launch_envs import MPI


def test_crash_line_skips_mindspores_rulers_and_names_the_rank():
    from msdist.base.errors import first_line
    message = "\n----------------------------------------------------\n- Kernel error:\n" \
              "----------------------------------------------------\nLaunch kernel failed: Default/AllReduce-op0\n"
    assert first_line(message) == "Launch kernel failed: Default/AllReduce-op0"
    assert launch_env.rank_label(MPI) == " (rank 3)" and launch_env.rank_label({}) == ""
    assert rendezvous.node_timeout_s({}) == 30 and rendezvous.node_timeout_s({"MS_NODE_TIMEOUT": "10"}) == 10
