#!/bin/bash
# Job script written by `nodescale launch` for preset pbs-openmpi: 1 node(s) x 4 process(es), mode spawn.
# Directives come first: the scheduler reads them only up to the first command.
#PBS -N resnet_ddp
#PBS -l select=1:ncpus=32:mpiprocs=1
#PBS -l place=scatter
#PBS -l walltime=02:30:00
#PBS -A proj_123
#PBS -q workq
#PBS -j oe
#PBS -o /home/user/project/runs/resnet-ddp/

set -euo pipefail

# PBS starts the job in the home directory, not where qsub ran: go to the job's directory
# (an absolute path, so nothing depends on $PBS_O_WORKDIR).
cd /home/user/project

# The submitting shell's environment can reach the job (sbatch copies it, qsub -V too);
# launcher variables left from an earlier run would give every process a wrong rank.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT

# Environment of the cluster preset.
export GLOO_SOCKET_IFNAME=ib0
# Environment from --env (wins over the preset's).
export OMP_NUM_THREADS=8
export RUN_NOTE='lr 0.1, '"'"'warm'"'"' start'

# Rendezvous. The first node of the allocation hosts the c10d store that torchrun's
# agents (or the processes themselves) meet at. Which node that is, is known only once
# the job runs, so it is looked up here, never written in.
# PBS lists the job's hosts in $PBS_NODEFILE, the first node first. Its name is resolved
# to IPv4 here, on a compute node: names need not resolve the same way on the login node.
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
head_node=$(head -n 1 "$PBS_NODEFILE")
head_addr=$head_node
MASTER_ADDR=$(nodescale_ipv4 "$head_addr")
MASTER_PORT=$(nodescale_port "$PBS_JOBID")
export MASTER_ADDR MASTER_PORT
echo "nodescale: rendezvous at $MASTER_ADDR:$MASTER_PORT"

# Preemption and wall time: PBS warns no one before the wall time, so this script sends
# itself USR1 120 s before it; `qsig -s USR1 JOBID` does the same at any time.
# The trap passes it on to mpiexec, which passes it on to the processes it started. The ranks
# stop at the next step boundary, checkpoint and exit; the job is then rerun with qrerun
# (a `nodescale train --out DIR --resume` command continues).
# Rank 0 writes NODESCALE_REQUEUE_FILE when the ranks stopped for requeue (torchrun hides their exit code).
export NODESCALE_REQUEUE_FILE=/home/user/project/runs/resnet-ddp/requeue-"$PBS_JOBID"
rm -f "$NODESCALE_REQUEUE_FILE"
( sleep 8880 && kill -USR1 $$ ) >/dev/null 2>&1 &
timer_pid=$!

# In the background, so that the trap runs when the signal comes, not when the launch ends.
step_pid=
trap 'echo "nodescale: USR1 received: passing it on to the ranks"; kill -USR1 "$step_pid" 2>/dev/null || true' USR1
# Spawn mode: the command runs once, on one node, and starts its own processes.
# CPU binding is off unless the preset sets one: a launcher bound to one core would share
# it with every process it starts.
# -x: Open MPI's daemons on other nodes pass on only the variables named so.
mpiexec -n 1 --hostfile "$PBS_NODEFILE" --map-by ppr:1:node --bind-to none -x PATH -x MASTER_ADDR -x MASTER_PORT -x PBS_JOBID -x GLOO_SOCKET_IFNAME -x OMP_NUM_THREADS -x RUN_NOTE -x NODESCALE_REQUEUE_FILE \
    bash -c '
        trap "" USR1  # only the ranks act on the stop signal; it must not end this launcher
        exec "$@"
    ' \
    nodescale-spawn nodescale train --config /home/user/project/resnet.yaml --set epochs=3 &
step_pid=$!
# wait returns early when the trap ran; wait again until the launch itself has ended.
step_status=0
while true; do
    wait "$step_pid" && step_status=0 || step_status=$?
    kill -0 "$step_pid" 2>/dev/null || break
done
kill "$timer_pid" 2>/dev/null || true

# Exit code 3 (or the marker): the ranks stopped on the signal and wrote a checkpoint.
if [ "$step_status" -eq 3 ] || [ -e "$NODESCALE_REQUEUE_FILE" ]; then
    echo "nodescale: stopped for requeue (exit code $step_status): rerunning PBS job $PBS_JOBID"
    qrerun "$PBS_JOBID"
    exit 0
fi
exit "$step_status"
