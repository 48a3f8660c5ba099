#!/usr/bin/env bash
# On a GPU machine (never in CI): the CUDA tests, then the single-GPU throughput benchmark.
#
#   bash scripts/gpu-wheels.sh                    # here, once: wheels the bare GPU image lacks
#   bash scripts/gpu-check.sh tests|bench|all [throughput.py flags]   # there, with .whl carried
#   bash scripts/gpu-check.sh bench --cases gpt2_small --quick       # GPT-2 small tokens/s and MFU, ~3 min
#   bash scripts/gpu-check.sh plan [plan_gpu.py flags]   # nodescale plan against ResNet-50, ViT-B/16 runs, ~2 min
#   bash scripts/gpu-check.sh data [input_pipeline.py flags]        # --decode gpu: its tests, then CPU vs GPU
#                                                                  # decoding images/s (~5 min; needs torchvision:
#                                                                  # the image's, or TORCHVISION=x.y.z gpu-wheels.sh)
#
# One device call runs at most 10 minutes: run `tests` and `bench` in separate calls there.
# Results (JUnit XML, logs, benchmark JSON) go to $OUT when it is set (the device tool's
# folder that comes back), else to ./gpu-check-out.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
if ! python3 -c "import pydantic" 2>/dev/null || { [[ "$what" == data ]] && ! python3 -c "import torchvision" 2>/dev/null; }; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu-check: no wheels in .whl/: run scripts/gpu-wheels.sh here and carry .whl" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" \
    | tee -a "$out/gpu.txt"
status=0
if [[ "$what" == tests || "$what" == all ]]; then
    # One process: the GPU image need not have pytest-xdist (pyproject.toml asks for -n 2).
    python3 -m pytest tests/gpu -v -p no:cacheprovider -o addopts="-ra --strict-markers" --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
    status=${PIPESTATUS[0]}
fi
if [[ "$what" == data ]]; then
    python3 -c "import torchvision.io" 2>&1 | tail -1 | tee "$out/torchvision.txt"
    python3 -m pytest tests/gpu/test_gpu_decode.py -v -p no:cacheprovider -o addopts="-ra --strict-markers" \
        --junitxml="$out/gpu-decode-tests.xml" 2>&1 | tee "$out/gpu-decode-tests.log"
    status=${PIPESTATUS[0]}
    # A smaller folder than the CPU benchmark's 20k: a GPU decodes it in seconds; 16 workers feed the CPU side.
    python3 benchmarks/input_pipeline.py --decode gpu --root /tmp/ns-input-pipeline --images 20000 --per-pass 4096 \
        --workers 15 --batch-size 256 --out "$out/input-pipeline-gpu.json" "${@:2}" 2>&1 | tee "$out/input-pipeline.log"
    (( status == 0 )) && status=${PIPESTATUS[0]}
fi
if [[ "$what" == bench || "$what" == all ]]; then
    python3 benchmarks/throughput.py --out "$out/throughput.json" "${@:2}" 2>&1 | tee "$out/throughput.log"
    (( status == 0 )) && status=${PIPESTATUS[0]}
fi
if [[ "$what" == plan ]]; then  # not in `all`: one call each; without CUDA it prints the plan's side and exits 2
    python3 benchmarks/plan_gpu.py --out "$out/plan-gpu.json" "${@:2}" 2>&1 | tee "$out/plan-gpu.log"
    status=${PIPESTATUS[0]}
fi
exit "$status"
