"""The environment each launcher gives a rank (mpirun, srun, msrun), for the launch-detection and job tests."""

# What OpenMPI gives rank 3 of 4, two ranks per node.
MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
       "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "77", "OMPI_COMMAND": "python", "PMIX_RANK": "3"}


# What srun gives task 5 of `srun -N2 --ntasks-per-node=4` (a job step; SLURM_STEP_ID marks it).
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}


# What msrun exports to worker 1 of `msrun --worker_num 4 --local_worker_num 2 --node_rank 0`.
MSRUN_WORKER = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_NODE_ID": "1", "MS_SCHED_HOST": "127.0.0.1",
                "MS_SCHED_PORT": "8118", "RANK_ID": "1", "RANK_SIZE": "4", "DEVICE_ID": "1"}


MSRUN_ARGV = ["python", "/usr/bin/msrun", "--worker_num", "4", "--local_worker_num=2", "msdist/train.py"]


def fields(launch):
    return (launch.kind, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size)
