#!/bin/bash
# Job script written by `nodescale launch` for preset generic-slurm: 1 node(s) x 4 process(es), mode spawn.
# Directives come first: the scheduler reads them only up to the first command.
#SBATCH --job-name=nodescale
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --gres=gpu:4
#SBATCH --time=01:00:00
#SBATCH --account=project_0001
#SBATCH --output=/home/user/project/nodescale-jobs/slurm-%j.out
#SBATCH --error=/home/user/project/nodescale-jobs/slurm-%j.err
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail

# Run in the job's directory, whatever directory sbatch was called from.
cd /home/user/project

# The submitting shell's environment can reach the job (sbatch copies it, qsub -V too);
# launcher variables left from an earlier run would give every process a wrong rank.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT

# Rendezvous. The first node of the allocation hosts the c10d store that torchrun's
# agents (or the processes themselves) meet at. Which node that is, is known only once
# the job runs, so it is looked up here, never written in.
# Its address is Slurm's NodeAddr for it (scontrol): node names need not resolve on the
# compute nodes, or may resolve to another network; a name is then resolved to IPv4 here.
# The port derives from the job id (nodescale.distributed.env.port_for_job): the same on every
# node, and different for two jobs that share a node, unlike a fixed 29500.
nodescale_ipv4() {
    local found
    found=$(getent ahostsv4 "$1" 2>/dev/null) || found=""
    found=${found%%[[:space:]]*}
    echo "${found:-$1}"
}
nodescale_port() {
    if [[ -z "${1//[[:space:]]/}" ]]; then
        echo 29500
    elif [[ $1 =~ ^[[:space:]]*([0-9]+)(\[([0-9]*)\])? ]]; then
        echo $(( 15000 + (10#${BASH_REMATCH[1]} + 10#${BASH_REMATCH[3]:-0}) % 15000 ))
    else
        python3 -c 'import sys, zlib; print(15000 + zlib.crc32(sys.argv[1].strip().encode()) % 15000)' "$1"
    fi
}
job_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${job_nodes%%$'\n'*}
head_info=$(scontrol show node "$head_node" 2>/dev/null) || head_info=""
if [[ $head_info =~ NodeAddr=([^[:space:]]+) ]]; then head_addr=${BASH_REMATCH[1]}; else head_addr=$head_node; fi
MASTER_ADDR=$(nodescale_ipv4 "$head_addr")
MASTER_PORT=$(nodescale_port "$SLURM_JOB_ID")
export MASTER_ADDR MASTER_PORT
echo "nodescale: rendezvous at $MASTER_ADDR:$MASTER_PORT"

# Preemption and wall time: 120 s before the end Slurm sends USR1 to this script
# (--signal, or `scancel --signal=USR1 --batch`); srun passes it on to every process of the step.
# The ranks stop at the next step boundary, checkpoint and exit; the job is then requeued and
# runs this script again (a `nodescale train --out DIR --resume` command continues).
# Rank 0 writes NODESCALE_REQUEUE_FILE when the ranks stopped for requeue (torchrun hides their exit code).
export NODESCALE_REQUEUE_FILE=/home/user/project/nodescale-jobs/requeue-"$SLURM_JOB_ID"
rm -f "$NODESCALE_REQUEUE_FILE"

# In the background, so that the trap runs when the signal comes, not when the launch ends.
step_pid=
trap 'echo "nodescale: USR1 received: passing it on to the ranks"; kill -USR1 "$step_pid" 2>/dev/null || true' USR1
# Spawn mode: the command runs once, on one node, and starts its own processes.
# --cpus-per-task is repeated on srun: Slurm 22.05 to 23.02 do not pass the job's value on
# to steps, and every task would get one core.
srun --nodes=1 --ntasks=1 --cpus-per-task=16 \
    bash -c '
        trap "" USR1  # only the ranks act on the stop signal; it must not end this launcher
        exec "$@"
    ' \
    nodescale-spawn nodescale train --model resnet50 &
step_pid=$!
# wait returns early when the trap ran; wait again until the launch itself has ended.
step_status=0
while true; do
    wait "$step_pid" && step_status=0 || step_status=$?
    kill -0 "$step_pid" 2>/dev/null || break
done

# Exit code 3 (or the marker): the ranks stopped on the signal and wrote a checkpoint.
if [ "$step_status" -eq 3 ] || [ -e "$NODESCALE_REQUEUE_FILE" ]; then
    echo "nodescale: stopped for requeue (exit code $step_status): requeueing Slurm job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$step_status"
