#!/bin/bash
# Job script written by `nodescale launch` for preset slurm-gres: 2 node(s) x 4 process(es), mode torchrun.
# Directives come first: the scheduler reads them only up to the first command.
#SBATCH --job-name=resnet_ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=6
#SBATCH --gres=gpu:v100:4
#SBATCH --time=02:30:00
#SBATCH --account=proj_123
#SBATCH --partition=gpu
#SBATCH --output=/home/user/project/runs/resnet-ddp/slurm-%j.out
#SBATCH --error=/home/user/project/runs/resnet-ddp/slurm-%j.err
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --mem=64G
#SBATCH --constraint="a100&ib"
#SBATCH --exclude="node[01-02],node7"
#SBATCH --nodelist=gpu3
#SBATCH --qos=high
#SBATCH --reservation=maint_2026
#SBATCH --dependency=afterok:4815162:4815163,afterany:4815170
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=alice@example.org
#SBATCH --licenses=scratch:1
#SBATCH --exclusive

set -euo pipefail

# Run in the job's directory, whatever directory sbatch was called from.
cd /home/user/project

# Launcher variables the submitting shell passed on (sbatch, qsub -V) would give every process a wrong rank.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT

# The preset's and the command line's software environment; -u is off: module and activation scripts read unset variables.
set +u
module load pytorch/2.1
module load cuda/12.2
module load 'nccl aws'
# The submitting Python environment, after the modules: sbatch copies PATH, but that is not activation,
# and a module load can put another python first (qsub copies nothing).
source /home/user/venvs/torch/bin/activate
export TMPDIR=/scratch/$USER/tmp
set -u

# Environment of the cluster preset.
export NCCL_DEBUG=WARN
# Environment from --env (wins over the preset's).
export OMP_NUM_THREADS=8
export RUN_NOTE='lr 0.1, '"'"'warm'"'"' start'

# Rendezvous: the allocation's first node hosts the c10d store, looked up here as the job runs;
# the port derives from the job id: the same on every node, another for each job.
# Its address is Slurm's NodeAddr (scontrol): node names need not resolve on the compute nodes.
job_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${job_nodes%%$'\n'*}
head_info=$(scontrol show node "$head_node" 2>/dev/null) || head_info=""
if [[ $head_info =~ NodeAddr=([^[:space:]]+) ]]; then head_addr=${BASH_REMATCH[1]}; else head_addr=$head_node; fi
MASTER_ADDR=$(python3 -c 'import socket, sys; print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])' "$head_addr" 2>/dev/null) || MASTER_ADDR=$head_addr
MASTER_PORT=$(python3 -c 'import re, sys, zlib; j = sys.argv[1].strip(); m = re.match(r"(\d+)(?:\[(\d*)\])?", j); print(29500 if not j else 15000 + (int(m[1]) + int(m[2] or 0) if m else zlib.crc32(j.encode())) % 15000)' "$SLURM_JOB_ID")
export MASTER_ADDR MASTER_PORT
echo "nodescale: rendezvous at $MASTER_ADDR:$MASTER_PORT"

# Preemption and wall time: Slurm sends USR1 120 s before the end (or `scancel --signal=USR1 --batch`);
# the ranks checkpoint at the next step and exit, and the job is requeued (--resume continues it).
# Rank 0 writes NODESCALE_REQUEUE_FILE, with its checkpoint's step, once every rank stopped for requeue:
# the only evidence believed (any program may exit 3, and torchrun exits 1 whatever its workers did).
export NODESCALE_REQUEUE_FILE=/home/user/project/runs/resnet-ddp/requeue-"$SLURM_JOB_ID"
requeue_count_file=/home/user/project/runs/resnet-ddp/requeues-"$SLURM_JOB_ID"
# A requeued job keeps its id: the step its previous run stopped at, where stopping again is no progress.
previous_stop=$(sed -n 's/^step=//p' "$NODESCALE_REQUEUE_FILE" 2>/dev/null) || previous_stop=""
rm -f "$NODESCALE_REQUEUE_FILE"

# In the background, so the trap runs when the signal comes; wait again until the launch has ended.
step_pid=
trap 'echo "nodescale: USR1 received: passing it on to the ranks"; kill -USR1 "$step_pid" 2>/dev/null || true' USR1
# torchrun mode: one torchrun per node, each starting 4 processes.
# --cpus-per-task again: Slurm 22.05 to 23.02 do not pass the job's value on to steps.
# --kill-on-bad-exit: one failed task ends the step, not leaving the others waiting.
# The command reaches the script below as its arguments ("$@"), never re-quoted.
srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=6 --label --kill-on-bad-exit=1 \
    bash -c '
        trap "" USR1  # the torchrun agent below catches it: its workers start with the default action
        # On every node. The first hosts the store (is_host=1); local_addr is this node as the others
        # reach it (its route to MASTER_ADDR), where torchrun would guess from the host name (often loopback).
        node_rank=$SLURM_NODEID
        if [ "$node_rank" = 0 ]; then is_host=1; else is_host=0; fi
        local_addr=$(python3 -c "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((sys.argv[1], int(sys.argv[2]))); print(s.getsockname()[0])" "$MASTER_ADDR" "$MASTER_PORT" 2>/dev/null) || local_addr=$(hostname)
        exec 2>&1  # one stream per rank: its traceback stays in order with its other lines
        export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank\${rank}]:"  # with --tee=3: each line its rank
        # Each rank bound to the NUMA node of its GPU, where this torch and this node allow it (numa_binding.py).
        numa_binding=$(python3 -m nodescale.launch.numa_binding 2>/dev/null) || numa_binding=
        exec python3 -c "import os, runpy, shutil, signal, sys; path = shutil.which(\"torchrun\") or sys.exit(\"torchrun: not found on PATH\"); b\"python\" in open(path, \"rb\").readline() or os.execv(path, [path, *sys.argv[1:]]); signal.signal(signal.SIGUSR1, lambda *_: None); sys.argv[0] = path; runpy.run_path(path, run_name=\"__main__\")" --nnodes=2 --nproc-per-node=4 \
            --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
            --rdzv-conf=is_host="$is_host" --local-addr="$local_addr" --tee=3 $numa_binding --no-python "$@"
    ' \
    nodescale-node nodescale train --config /home/user/project/resnet.yaml --set epochs=3 &
step_pid=$!
step_status=0
while true; do
    wait "$step_pid" && step_status=0 || step_status=$?
    kill -0 "$step_pid" 2>/dev/null || break
done

# A failed step: the job log's last lines name the rank that failed first (not rank 0's lost peer).
if [ "$step_status" -ne 0 ] && [ ! -e "${NODESCALE_REQUEUE_FILE:-/nonexistent}" ]; then
    python3 -m nodescale.launch.first_failure "$SLURM_JOB_ID" /home/user/project/runs/resnet-ddp/slurm-"$SLURM_JOB_ID".out /home/user/project/runs/resnet-ddp/slurm-"$SLURM_JOB_ID".err 2>/dev/null || echo "nodescale: the step failed (exit code $step_status): \`nodescale logs $SLURM_JOB_ID\` shows each rank's lines"
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
        echo "nodescale: stopped for requeue at step $stop_step (requeue $((requeues + 1)) of 20): requeueing Slurm job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    step_status=3
elif [ "$step_status" -eq 3 ]; then
    echo "nodescale: the step exited with 3 but no rank wrote the requeue marker (no stop at a checkpoint): a failure, not requeued"
fi
exit "$step_status"
