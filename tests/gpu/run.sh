#!/usr/bin/env bash
# The GPU path in one command (README, "On a GPU"), on a machine with CUDA torch and NVML:
#   bash tests/gpu/run.sh
# Where Ray is not installed, build .gpu/ first with ../shared/tools/gpu-bundle: this script
# sources its setup. GPU_SHARE=1 (the default here) lets several NCCL ranks share one GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GPU_SHARE="${GPU_SHARE:-1}" PYTHONUNBUFFERED=1
if [ -f .gpu/setup.sh ]; then source .gpu/setup.sh; fi
out="${OUT:-bench-output}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$out/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu-tests.log"
python3 -m ray_graceful.tools.cli bench release --backend nccl --sizes 2,4,8 --reps 5 --timeout 30 \
  --json "$out/release-nccl.json" 2>&1 | tee "$out/release-nccl.log"
