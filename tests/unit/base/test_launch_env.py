"""msdist.base.launch_env: who this process is under every launcher, from environment variables alone
(tests/launch_envs.py holds what each launcher really sets)."""
from msdist.base import launch_env
from launch_envs import MPI, SRUN, MSRUN_WORKER, MSRUN_ARGV, fields


def test_standalone():
    assert fields(launch_env.detect_launch({})) == ("standalone", 0, 1, 0, 1)


def test_mpirun():
    mpi = launch_env.detect_launch(MPI)
    assert fields(mpi) + (mpi.job_id,) == ("mpirun", 3, 4, 1, 2, "77")


def test_msdist_launch_worker():
    env = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_NODE_ID": "3", "MSDIST_LOCAL_RANK": "1",
           "MSDIST_LOCAL_WORLD_SIZE": "2"}
    launch = launch_env.detect_launch(env)
    assert fields(launch) == ("cluster", 3, 4, 1, 2) and launch.launcher == "msdist.launch"


def test_msrun_worker_takes_local_rank_from_device_id_and_local_size_from_msrun():
    launch = launch_env.detect_launch(MSRUN_WORKER, parent=MSRUN_ARGV)
    assert fields(launch) == ("cluster", 1, 4, 1, 2) and launch.launcher == "msrun"
    # One node (msrun's default --local_worker_num equals --worker_num): every rank is local.
    assert launch_env.detect_launch(MSRUN_WORKER, parent=["msrun", "--worker_num", "4"]).local_world_size == 4
    assert launch_env.msrun_local_worker_num(["msrun", "--local_worker_num", "8"]) == 8


def test_msrun_scheduler_role_is_not_standalone():
    env = {"MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118",
           "RANK_ID": "0", "RANK_SIZE": "2"}
    launch = launch_env.detect_launch(env)
    assert (launch.kind, launch.world_size, launch.launcher) == ("scheduler", 2, "msrun")


def test_srun_tasks_form_one_job():
    launch = launch_env.detect_launch(SRUN)
    assert fields(launch) + (launch.job_id,) == ("slurm", 5, 8, 1, 4, "4242.0")
    # Without SLURM_NTASKS_PER_NODE, Slurm's compact per-node list gives the count.
    env = {k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}
    assert launch_env.detect_launch({**env, "SLURM_TASKS_PER_NODE": "4(x2)"}).local_world_size == 4


def test_batch_script_without_srun_stays_standalone():
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    batch["SLURM_PROCID"] = "0"
    assert launch_env.detect_launch(batch).kind == "standalone"


def test_mpirun_inside_a_slurm_allocation_is_mpirun():
    assert launch_env.detect_launch({**SRUN, **MPI}).kind == "mpirun"


def test_launcher_worker_inside_srun_is_the_launchers():
    env = {**SRUN, "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "8", "MS_NODE_ID": "6", "MSDIST_LOCAL_RANK": "2",
           "MSDIST_LOCAL_WORLD_SIZE": "4"}
    assert fields(launch_env.detect_launch(env)) == ("cluster", 6, 8, 2, 4)
