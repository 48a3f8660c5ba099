#!/bin/bash
# Job script written by `nodescale launch` for preset generic-slurm: 2 node(s) x 1 process(es), mode per-gpu.
# Directives come first: the scheduler reads them only up to the first command.
#SBATCH --job-name=nodescale
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --gres=gpu:1
#SBATCH --time=01:00:00
#SBATCH --output=/work/project/jobs/slurm-%j.out
#SBATCH --error=/work/project/jobs/slurm-%j.err
#SBATCH --no-kill

set -euo pipefail

# Run in the job's directory, whatever directory sbatch was called from.
cd /work/project

# Launcher variables the submitting shell passed on (sbatch, qsub -V) would give every process a wrong rank.
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT

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

# Restarts (nodescale launch --max-restarts 2): the step runs again after a failure, and its ranks
# resume from the newest checkpoint (NODESCALE_RESTART_COUNT). A user error (exit code 2,
# or a rank's message in NODESCALE_ERROR_DIR) is not retried; a stop for requeue is requeued.
export NODESCALE_MAX_RESTARTS=2
export NODESCALE_ERROR_DIR=/work/project/jobs/errors-"$SLURM_JOB_ID"
step_report=/work/project/jobs/step-"$SLURM_JOB_ID".txt
node_lost='^srun: error: ([^ :]+): tasks? [0-9,-]+: Killed|^srun: error: Node failure on ([^ ]+)'
export NODESCALE_BAD_NODES_FILE=/work/project/jobs/bad-nodes-"$SLURM_JOB_ID".txt
bad_nodes=""
load_bad_nodes() {
    [ -r "$NODESCALE_BAD_NODES_FILE" ] || return 0
    local node why
    while IFS=$'\t' read -r node why || [ -n "$node" ]; do
        [[ $node =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$ && ",$bad_nodes," != *",$node,"* ]] || continue
        bad_nodes=${bad_nodes:+$bad_nodes,}$node; echo "nodescale: leaving node $node out: $why"
    done < "$NODESCALE_BAD_NODES_FILE"
}
restart=0 first=""
NODESCALE_RESTART_REASON=""
while true; do
    rm -rf "$NODESCALE_ERROR_DIR" && mkdir -p "$NODESCALE_ERROR_DIR"
    export NODESCALE_RESTART_COUNT=$restart NODESCALE_RESTART_REASON
    rm -f "$step_report" "$step_report.done"
    load_bad_nodes  # srun's killed nodes, and those nodescale doctor or bench comm --pairs flagged
    # The first 2 nodes that have not failed; failed ones only when too few others are left.
    good="" suspect="" good_count=0
    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
        if [[ ",$bad_nodes," == *",$node,"* ]]; then suspect="$suspect $node"; else good="$good $node"; good_count=$((good_count + 1)); fi
    done
    if [ "$good_count" -lt 2 ]; then
        echo "nodescale: only $good_count nodes have not failed, 2 needed: using $bad_nodes again (--spare-nodes keeps nodes in reserve)"
    fi
    step_nodes="" count=0
    for node in $good $suspect; do
        if [ "$count" -lt 2 ]; then step_nodes=${step_nodes:+$step_nodes,}$node; count=$((count + 1)); fi
    done
    head_node=${step_nodes%%,*}
    head_info=$(scontrol show node "$head_node" 2>/dev/null) || head_info=""
    if [[ $head_info =~ NodeAddr=([^[:space:]]+) ]]; then head_addr=${BASH_REMATCH[1]}; else head_addr=$head_node; fi
    MASTER_ADDR=$(python3 -c 'import socket, sys; print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])' "$head_addr" 2>/dev/null) || MASTER_ADDR=$head_addr
    echo "nodescale: step on $step_nodes${bad_nodes:+ (left out: $bad_nodes)}, rendezvous at $MASTER_ADDR:$MASTER_PORT"
    step_status=0
    # per-gpu mode: one Slurm task per process, given torchrun's variables from Slurm's.
    # --cpus-per-task again: Slurm 22.05 to 23.02 do not pass the job's value on to steps.
    # --kill-on-bad-exit: one failed task ends the step, not leaving the others waiting.
    # The command reaches the script below as its arguments ("$@"), never re-quoted.
    srun --nodes=2 --ntasks-per-node=1 --ntasks=2 --nodelist="$step_nodes" --cpus-per-task=4 --label --kill-on-bad-exit=1 \
        bash -c '
            exec 2>&1  # one stream per rank: its traceback stays in order with its other lines
            export RANK=$SLURM_PROCID
            export LOCAL_RANK=$SLURM_LOCALID
            export WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=1
            export GROUP_RANK=$SLURM_NODEID
            export NODE_RANK=$GROUP_RANK
            exec "$@"
        ' \
        nodescale-task nodescale train --out run 2> >(awk -v report="$step_report" '{ print; fflush() } /^srun: error: / { print >> report; fflush(report) } END { close(report); printf "" > (report ".done") }' >&2) || step_status=$?
    if [ "$step_status" -eq 0 ]; then break; fi
    # srun's report goes through a filter: wait (a few seconds at most) until it has written everything.
    for _ in $(seq 1 100); do [ -e "$step_report.done" ] && break; sleep 0.1; done
    first=$(grep -m 1 -E '^srun: error: (Node failure on |[^ :]+: tasks? )' "$step_report" 2>/dev/null) || first=""
    if [ "$step_status" -eq 2 ] || [ -n "$(ls -A "$NODESCALE_ERROR_DIR")" ] || grep -q ': Exited with exit code 2$' "$step_report" 2>/dev/null; then
        for file in "$NODESCALE_ERROR_DIR"/rank-*.txt; do
            [ -e "$file" ] || continue
            rank=${file##*/rank-}; echo "nodescale: error (rank ${rank%.txt}): $(cat "$file")"; break
        done
        echo "nodescale: the step stopped on a user error (exit code 2): not restarted, it would fail the same way again"
        step_status=2; break
    fi
    if [ "$restart" -ge 2 ]; then
        echo "nodescale: the step failed (exit code $step_status) after 2 restart(s)${first:+: $first}"
        break
    fi
    NODESCALE_RESTART_REASON="the step exited with $step_status"
    if [[ $first =~ $node_lost ]]; then
        node=${BASH_REMATCH[1]}${BASH_REMATCH[2]}
        printf '%s\t%s\n' "$node" "its processes died (${first#srun: error: })" >> "$NODESCALE_BAD_NODES_FILE"
        NODESCALE_RESTART_REASON="node $node failed (${first#srun: error: })"
    fi
    restart=$((restart + 1))
    echo "nodescale: restart $restart of 2: the ranks resume from the newest checkpoint"
    echo "nodescale: restart $restart of 2" >&2  # srun reports failures in the .err file
done

# A failed step: the job log's last lines name the rank that failed first (not rank 0's lost peer).
if [ "$step_status" -ne 0 ] && [ ! -e "${NODESCALE_REQUEUE_FILE:-/nonexistent}" ]; then
    python3 -m nodescale.launch.first_failure "$SLURM_JOB_ID" /work/project/jobs/slurm-"$SLURM_JOB_ID".out /work/project/jobs/slurm-"$SLURM_JOB_ID".err 2>/dev/null || echo "nodescale: the step failed (exit code $step_status): \`nodescale logs $SLURM_JOB_ID\` shows each rank's lines"
fi
exit "$step_status"
