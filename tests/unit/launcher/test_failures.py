"""msdist.launcher.failures: the crash line names the rank and skips MindSpore's rulers."""
from msdist.base import launch_env
from msdist.cluster import rendezvous
from msdist.launcher.failures import Failure
from launch_envs import MPI


def test_crash_line_skips_mindspores_rulers_and_names_the_rank():
    from msdist.base.errors import first_line
    message = "\n----------------------------------------------------\n- Kernel error:\n" \
              "----------------------------------------------------\nLaunch kernel failed: Default/AllReduce-op0\n"
    assert first_line(message) == "Launch kernel failed: Default/AllReduce-op0"
    assert launch_env.rank_label(MPI) == " (rank 3)" and launch_env.rank_label({}) == ""
    assert rendezvous.node_timeout_s({}) == 30 and rendezvous.node_timeout_s({"MS_NODE_TIMEOUT": "10"}) == 10


def test_a_re_form_is_summed_up_by_its_cause_not_as_a_failed_scheduler():
    assert Failure(None, "node 10.0.0.3 lost: no answer for 10 s", reform=True).summary() == \
        "node 10.0.0.3 lost: no answer for 10 s"
    assert Failure(None, "exit code 1").summary() == "the scheduler failed: exit code 1"
