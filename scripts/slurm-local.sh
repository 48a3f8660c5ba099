#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine, for tests: munge + slurmctld + N slurmd "nodes"
# (node1..nodeN, all NodeAddr=127.0.0.1), no systemd, no cgroups, no accounting database.
#
#   scripts/slurm-local.sh up BASE [NNODES=2] [GPUS=0] [SHORT_MAXTIME]
#                                                         start it in BASE; prints `export SLURM_CONF=...`
#   scripts/slurm-local.sh down BASE                      cancel its jobs and stop its daemons
#
# Everything lives in BASE (config, munge key and socket, state, logs, pid files), and the
# ports are picked free at start, so two clusters in two BASE folders do not meet, and a
# cluster left running in BASE by an earlier run is taken down before a new one starts.
# Each node has this machine's cores (nproc, OMP_NUM_THREADS ignored): a job asking for one task with every core per node fits, and
# RealMemory=2000 (MB), so that a --mem above it is refused as on a real cluster.
# GPUS > 0 gives each node that many fake GPUs (GRES backed by /dev/null): Slurm then accepts
# and schedules --gres=gpu:N requests; the jobs still run on the CPU.
# SHORT_MAXTIME (e.g. 00:05:00) adds a second partition, `short`, of the same nodes with that
# MaxTime, so that a --time above a partition's limit can be refused; the default is `debug` alone.
# Needs: slurmctld, slurmd, sbatch/squeue/sinfo/scancel, munged, python3 (Debian: slurm-wlm munge).
set -euo pipefail
# The daemons live in /usr/sbin, which is not on every user's PATH.
PATH=$PATH:/usr/sbin:/sbin

usage() { echo "usage: $0 up BASE [NNODES] [GPUS] [SHORT_MAXTIME] | down BASE" >&2; exit 2; }

# Stop the daemons whose pid files are given, all at once (each takes a second or two), waiting
# up to 10 s before SIGKILL.
stop_pid_files() {
    local file pid alive pids=()
    for file in "$@"; do
        [ -f "$file" ] || continue
        pid=$(cat "$file" 2>/dev/null) || continue
        if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null && pids+=("$pid")
        fi
        rm -f "$file"
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    for _ in $(seq 1 100); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

down() {
    local base=$1
    [ -d "$base" ] || return 0
    base=$(cd "$base" && pwd)
    # Jobs first: a slurmd that stops leaves its job steps (slurmstepd and the job's processes) running.
    if [ -f "$base/slurm.conf" ] && [ -f "$base/slurmctld.pid" ] && kill -0 "$(cat "$base/slurmctld.pid")" 2>/dev/null; then
        export SLURM_CONF=$base/slurm.conf
        if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
            scancel --full $(squeue -h -o %i) 2>/dev/null || true
            # KillWait=2 below: a step that ignores SIGTERM gets SIGKILL after 2 s.
            for _ in $(seq 1 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
        fi
    fi
    stop_pid_files "$base"/slurmd-*.pid "$base/slurmctld.pid"
    # munge last: the Slurm daemons authenticate their last messages with it.
    stop_pid_files "$base/munge/munged.pid"
}

free_ports() {
    # N ports nothing listens on now (the kernel's choice; released before slurm binds them).
    python3 - "$1" <<'EOF'
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
EOF
}

up() {
    local base=$1 n=${2:-2} gpus=${3:-0} short=${4:-} short_partition=""
    [[ $n =~ ^[1-9][0-9]*$ && $gpus =~ ^[0-9]+$ && $short =~ ^([0-9:-]+)?$ ]] || usage
    [ -z "$short" ] || short_partition="PartitionName=short Nodes=ALL MaxTime=$short State=UP"
    for cmd in munged slurmctld slurmd sinfo squeue scancel python3; do
        command -v "$cmd" >/dev/null || { echo "slurm-local: $cmd not found (bash scripts/test-setup.sh installs it)" >&2; exit 3; }
    done
    mkdir -p "$base"
    base=$(cd "$base" && pwd)
    down "$base"
    rm -rf "$base/state" "$base/spool" "$base/log" "$base/munge"
    mkdir -p "$base/munge" "$base/state" "$base/spool" "$base/log"
    chmod 700 "$base/munge"

    # A key of its own: nothing outside BASE can talk to this cluster, nor it to others.
    dd if=/dev/urandom of="$base/munge/munge.key" bs=1 count=1024 status=none
    chmod 600 "$base/munge/munge.key"
    munged --force --socket="$base/munge/munge.sock" --key-file="$base/munge/munge.key" \
        --log-file="$base/munge/munged.log" --pid-file="$base/munge/munged.pid" \
        --seed-file="$base/munge/munged.seed"

    local host user ports ctl_port nodes="" gres="" gres_types="" i first_job_id=$((1000 + RANDOM % 13000))
    host=$(hostname -s)
    user=$(id -un)
    # nproc honours OMP_NUM_THREADS: a test process that set it to 1 made 1-CPU nodes, where salloc -c2 pended
    # for ever (PartitionConfig).
    local cpus
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    read -r -a ports <<<"$(free_ports $((n + 1)))"
    ctl_port=${ports[0]}
    if [ "$gpus" -gt 0 ]; then
        gres=" Gres=gpu:$gpus"
        gres_types="GresTypes=gpu"
        printf 'AutoDetect=off\nName=gpu Count=%s File=/dev/null\n' "$gpus" >"$base/gres.conf"
    else
        rm -f "$base/gres.conf"
    fi
    for i in $(seq 1 "$n"); do
        mkdir -p "$base/spool/node$i"
        nodes+="NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$cpus RealMemory=2000$gres State=UNKNOWN"$'\n'
    done
    cat >"$base/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: $n fake nodes on this host.
ClusterName=nodescale-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job is held before it may start again (120 s by default): short
# here so the requeue test waits seconds, not minutes.
AuthInfo=socket=$base/munge/munge.sock,cred_expire=10
StateSaveLocation=$base/state
SlurmdSpoolDir=$base/spool/%n
SlurmctldPidFile=$base/slurmctld.pid
SlurmdPidFile=$base/slurmd-%n.pid
SlurmctldLogFile=$base/log/slurmctld.log
SlurmdLogFile=$base/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$base/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node lines below win over what slurmd detects (memory, sockets of a VM).
SlurmdParameters=config_overrides
$gres_types
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# A node answering a ping late (a loaded 2-core CI machine) is dropped from scheduling until the next ping.
MessageTimeout=30
KillWait=2
# Finished jobs stay visible to scontrol/squeue -j for 5 minutes.
MinJobAge=300
# Job ids from a random start: two clusters on one machine would otherwise both run job 1, 2, ...
# and their jobs, deriving the rendezvous port from the id, would meet on the same port.
FirstJobId=$first_job_id
$nodes
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
$short_partition
EOF
    export SLURM_CONF=$base/slurm.conf
    slurmctld -f "$SLURM_CONF"
    for i in $(seq 1 "$n"); do slurmd -f "$SLURM_CONF" -N "node$i"; done
    local states=""
    for _ in $(seq 1 300); do
        states=$(sinfo -h -o %T 2>/dev/null | sort -u) || states=""
        [ "$states" = "idle" ] && break
        [[ $states == *inval* ]] && break
        sleep 0.1
    done
    if [ "$states" != "idle" ]; then
        echo "slurm-local: nodes not idle (state: ${states:-no answer}); logs in $base/log" >&2
        tail -n 20 "$base"/log/*.log >&2 || true
        exit 1
    fi
    echo "export SLURM_CONF=$SLURM_CONF"
}

case "${1:-}" in
    up) [ $# -ge 2 ] && [ $# -le 5 ] || usage; up "$2" "${3:-2}" "${4:-0}" "${5:-}" ;;
    down) [ $# -eq 2 ] || usage; down "$2" ;;
    *) usage ;;
esac
