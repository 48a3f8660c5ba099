#!/usr/bin/env bash
# Everything the test suite needs, on a fresh clone: `bash scripts/test-setup.sh && python -m pytest`.
#
# 1. System packages for the real-scheduler tests (a Slurm cluster on localhost, MPICH and
#    Open MPI mpiexec): installed with apt-get only when one of their commands is missing, so a
#    second run costs nothing. Without apt-get (not Debian/Ubuntu) it says what is missing and
#    goes on: those tests then skip (or fail where CI is set).
# 2. nodescale itself, editable, with its test extras; constraints.txt pins torch so pip never
#    swaps it for a CUDA build.
# 3. The frameworks whose users' scripts tests/test_launch_frameworks.py launches: Lightning and
#    Accelerate (wheels; pip only checks them when present), and DeepSpeed, which is an sdist:
#    built without build isolation (an isolated build could fetch a CUDA torch), and only when
#    `import deepspeed` fails, since pip would otherwise look it up again on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(slurm-wlm munge openmpi-bin mpich)
# One command per thing the tests start: the Slurm daemons and client, munge, both mpiexecs.
COMMANDS=(slurmctld slurmd sbatch squeue scancel sinfo munged mpiexec.openmpi mpiexec.mpich)

missing=()
for cmd in "${COMMANDS[@]}"; do
    # The daemons live in /usr/sbin, which is not on every user's PATH.
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd")
done

if [ ${#missing[@]} -gt 0 ]; then
    echo "test-setup: missing ${missing[*]}: installing ${PACKAGES[*]}"
    if [ "$(id -u)" = 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        sudo=(none)
    fi
    if ! command -v apt-get >/dev/null 2>&1 || [ "${sudo[*]}" = none ]; then
        echo "test-setup: cannot install them here (needs apt-get and root or sudo);" \
            "the Slurm and mpiexec tests will skip (fail where CI is set)" >&2
    else
        export DEBIAN_FRONTEND=noninteractive
        "${sudo[@]}" apt-get update
        "${sudo[@]}" apt-get install -y --no-install-recommends "${PACKAGES[@]}"
    fi
else
    echo "test-setup: ${PACKAGES[*]} present"
fi

python -m pip install -c constraints.txt -e ".[test]"
python -m pip install -c constraints.txt lightning accelerate
if python -c "import deepspeed" >/dev/null 2>&1; then
    echo "test-setup: deepspeed present"
else
    python -m pip install -c constraints.txt --no-build-isolation deepspeed
fi
