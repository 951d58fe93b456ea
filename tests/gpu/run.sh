#!/usr/bin/env bash
# The GPU path in one command (README, "On a GPU"), on a machine with CUDA torch and NVML:
#   bash tests/gpu/run.sh
# Where Ray is not installed, build .gpu/ first with ../shared/tools/gpu-bundle: this script
# sources its setup. GPU_SHARE=1 (the default here) lets several NCCL ranks share one GPU.
# RELEASE_ARGS sizes the NCCL release benchmark (default: 2, 4 and 8 ranks, 5 repetitions, the
# baseline waiting out a 30 s collective timeout); a short lease wants fewer, e.g.
#   RELEASE_ARGS="--sizes 2,4 --reps 3 --how sigterm --timeout 10" bash tests/gpu/run.sh
# Each stage runs even when the one before it failed; the script's status is the worst of them.
set -uo pipefail
cd "$(dirname "$0")/../.."
export GPU_SHARE="${GPU_SHARE:-1}" PYTHONUNBUFFERED=1
if [ -f .gpu/setup.sh ]; then
  source .gpu/setup.sh || exit 1
  # The bundle unpacks Ray's wheel with zipfile, which drops the executable bits of Ray's own
  # binaries (gcs_server, raylet): without them no local cluster starts ("Permission denied").
  find /tmp/site/ray/core /tmp/site/bin -type f ! -perm -u+x -exec chmod a+x {} + 2>/dev/null
fi
out="${OUT:-bench-output}"
mkdir -p "$out"
status=0
stage() {  # stage NAME COMMAND...: run it, log it under $out, remember a failure
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=$rc
}
stage gpu sh -c "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader && python3 -c \
  \"import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())\""
stage gpu-tests python3 -m pytest -q -s -rA -p no:cacheprovider --durations=10 tests/gpu
# shellcheck disable=SC2086  # RELEASE_ARGS is a list of arguments
stage release-nccl python3 -m ray_graceful.tools.cli bench release --backend nccl \
  ${RELEASE_ARGS:---sizes 2,4,8 --reps 5 --timeout 30} --json "$out/release-nccl.json"
exit "$status"
