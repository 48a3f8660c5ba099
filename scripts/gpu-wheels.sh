#!/usr/bin/env bash
# Fetch, here, the wheels nodescale needs that a bare GPU machine's image lacks (pydantic and
# its parts), into .whl/ (git-ignored), for scripts/gpu-check.sh to install there. The image
# has torch, numpy, PyYAML, rich, psutil, matplotlib, scikit-learn, h5py, tensorboard and
# nvidia-ml-py already; it runs Python 3.12 on x86-64 and cannot reach a package index.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    "pydantic==$(python3 -c 'import pydantic; print(pydantic.VERSION)')" \
    "pydantic-core==$(python3 -c 'import pydantic_core; print(pydantic_core.__version__)')" \
    annotated-types==0.7.0 typing-inspection==0.4.2
# --decode gpu needs torchvision; where the GPU image lacks it: TORCHVISION=<the version built for its torch>.
if [[ -n "${TORCHVISION:-}" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "torchvision==$TORCHVISION"
fi
ls .whl
