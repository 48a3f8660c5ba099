#!/bin/bash
# Job script written by `nodescale launch` for preset pbs-openmpi: 2 node(s) x 4 process(es), mode torchrun.
# Directives come first: the scheduler reads them only up to the first command.
#PBS -N resnet_ddp
#PBS -l select=2:ncpus=32:mpiprocs=1
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

# Launcher variables the submitting shell passed on (sbatch, qsub -V) would give every process a wrong rank.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT

# Environment of the cluster preset.
export GLOO_SOCKET_IFNAME=ib0
# Environment from --env (wins over the preset's).
export OMP_NUM_THREADS=8
export RUN_NOTE='lr 0.1, '"'"'warm'"'"' start'

# PBS copies the job's output to the job directory only at its end: a copy as it is written, for
# `nodescale logs` (and --follow) and for the failure summary at the end.
ranks_log=/home/user/project/runs/resnet-ddp/pbs-"${PBS_JOBID%%.*}".log
exec > >(tee -a "$ranks_log") 2>&1
# mpiexec's labels name no host: the failure summary finds a task's host from this line (first_failure).
echo "nodescale: mpiexec places 1 task(s) on each host, in this order: $(awk '!seen[$0]++' "$PBS_NODEFILE" | paste -sd ' ')"

# Rendezvous: the allocation's first node hosts the c10d store, looked up here as the job runs;
# the port derives from the job id: the same on every node, another for each job.
# $PBS_NODEFILE lists the hosts, the first first; resolved here: the login node may resolve names otherwise.
head_node=$(head -n 1 "$PBS_NODEFILE")
head_addr=$head_node
MASTER_ADDR=$(python3 -c 'import socket, sys; print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])' "$head_addr" 2>/dev/null) || MASTER_ADDR=$head_addr
MASTER_PORT=$(python3 -c 'import re, sys, zlib; j = sys.argv[1].strip(); m = re.match(r"(\d+)(?:\[(\d*)\])?", j); print(29500 if not j else 15000 + (int(m[1]) + int(m[2] or 0) if m else zlib.crc32(j.encode())) % 15000)' "$PBS_JOBID")
export MASTER_ADDR MASTER_PORT
echo "nodescale: rendezvous at $MASTER_ADDR:$MASTER_PORT"

# Preemption and wall time: PBS warns no one, so the script sends itself USR1 120 s before the end (`qsig -s USR1 JOBID`
# at any time); mpiexec passes it on, the ranks checkpoint and exit, qrerun reruns the job (--resume).
# Rank 0 writes NODESCALE_REQUEUE_FILE, with its checkpoint's step, once every rank stopped for requeue:
# the only evidence believed (any program may exit 3, and torchrun exits 1 whatever its workers did).
export NODESCALE_REQUEUE_FILE=/home/user/project/runs/resnet-ddp/requeue-"$PBS_JOBID"
requeue_count_file=/home/user/project/runs/resnet-ddp/requeues-"$PBS_JOBID"
# A requeued job keeps its id: the step its previous run stopped at, where stopping again is no progress.
previous_stop=$(sed -n 's/^step=//p' "$NODESCALE_REQUEUE_FILE" 2>/dev/null) || previous_stop=""
rm -f "$NODESCALE_REQUEUE_FILE"
( sleep 8880 && kill -USR1 $$ ) >/dev/null 2>&1 &
timer_pid=$!

# In the background, so the trap runs when the signal comes; wait again until the launch has ended.
step_pid=
trap 'echo "nodescale: USR1 received: passing it on to the ranks"; kill -USR1 "$step_pid" 2>/dev/null || true' USR1
# torchrun mode: one torchrun per node, each starting 4 processes.
# CPU binding off unless the preset sets one: a launcher bound to one core shares it with its processes.
# -x: Open MPI's daemons on other nodes pass on only the variables named so.
# The command reaches the script below as its arguments ("$@"), never re-quoted.
mpiexec -n 2 --hostfile "$PBS_NODEFILE" --map-by ppr:1:node --bind-to none --tag-output -x PATH -x MASTER_ADDR -x MASTER_PORT -x PBS_JOBID -x GLOO_SOCKET_IFNAME -x OMP_NUM_THREADS -x RUN_NOTE -x NODESCALE_REQUEUE_FILE \
    bash -c '
        export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
        # On every node. The first hosts the store (is_host=1); local_addr is this node as the others
        # reach it (its route to MASTER_ADDR), where torchrun would guess from the host name (often loopback).
        node_rank=${PALS_NODEID:-${PMI_RANK:-${OMPI_COMM_WORLD_RANK:?mpiexec set no rank variable}}}
        if [ "$node_rank" = 0 ]; then is_host=1; else is_host=0; fi
        local_addr=$(python3 -c "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], int(sys.argv[2]))); print(s.getsockname()[0])" "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null) || local_addr=$(hostname)
        exec 2>&1  # one stream per rank: its traceback stays in order with its other lines
        export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank\${rank}]:"  # with --tee=3: each line its rank
        exec torchrun --nnodes=2 --nproc-per-node=4 \
            --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$PBS_JOBID" \
            --rdzv-conf=is_host="$is_host" --local-addr="$local_addr" --tee=3 --no-python "$@"
    ' \
    nodescale-node nodescale train --config /home/user/project/resnet.yaml --set epochs=3 &
step_pid=$!
step_status=0
while true; do
    wait "$step_pid" && step_status=0 || step_status=$?
    kill -0 "$step_pid" 2>/dev/null || break
done
kill "$timer_pid" 2>/dev/null || true

# A failed step: the job log's last lines name the rank that failed first (not rank 0's lost peer).
if [ "$step_status" -ne 0 ] && [ ! -e "${NODESCALE_REQUEUE_FILE:-/nonexistent}" ]; then
    python3 -m nodescale.launch.first_failure "$PBS_JOBID" "$ranks_log" 2>/dev/null || echo "nodescale: the step failed (exit code $step_status): \`nodescale logs $PBS_JOBID\` shows each rank's lines"
fi

# Requeued on the marker only; not when the run stopped again where it resumed, nor past --max-requeues.
if [ -e "$NODESCALE_REQUEUE_FILE" ]; then
    stop_step=$(sed -n 's/^step=//p' "$NODESCALE_REQUEUE_FILE")
    requeues=$(cat "$requeue_count_file" 2>/dev/null) || requeues=0
    [[ $requeues =~ ^[0-9]+$ ]] || requeues=0
    if [ -n "$previous_stop" ] && [ "$stop_step" = "$previous_stop" ]; then
        echo "nodescale: stopped again at step $stop_step, where the previous run stopped: not requeued, it made no progress (does the command resume from its checkpoint?)"
    elif [ "$requeues" -ge 20 ]; then
        echo "nodescale: stopped at step $stop_step: not requeued, the job was requeued $requeues times already (--max-requeues 20)"
    else
        echo "$((requeues + 1))" > "$requeue_count_file"
        echo "nodescale: stopped for requeue at step $stop_step (requeue $((requeues + 1)) of 20): rerunning PBS job $PBS_JOBID"
        qrerun "$PBS_JOBID"
        exit 0
    fi
    step_status=3
elif [ "$step_status" -eq 3 ]; then
    echo "nodescale: the step exited with 3 but no rank wrote the requeue marker (no stop at a checkpoint): a failure, not requeued"
fi
exit "$step_status"
