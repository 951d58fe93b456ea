#!/usr/bin/env bash
# The GPU path in one command (README, "On a GPU"), on a machine with CUDA torch and NVML:
#   bash tests/gpu/run.sh
# Sized for one short lend: every stage has its own time limit (about 9.5 minutes if every one
# ran to its limit; 6-8 minutes seen as planned), prints as it goes, and runs even when the one
# before it failed; the script's status is the worst of them. Results go to $OUT (default
# bench-output/), beside each stage's log.
# Where Ray is not installed, build .gpu/ first with ../shared/tools/gpu-bundle: this script
# sources its setup. GPU_SHARE=1 (the default here) lets several NCCL ranks share one GPU; the
# harnesses give each rank its own NCCL_HOSTID themselves.
# Override a stage's arguments: RELEASE_ARGS, RESTART_ARGS, ABORT_ARGS.
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
started=$SECONDS
source tests/gpu/stage.sh
stage versions 60 sh -c "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader && \
  python3 -c \"import torch, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'nccl', torch.cuda.nccl.version(), 'ray', ray.__version__)\""
stage gpu-tests 90 python3 -m pytest -q -s -rA -p no:cacheprovider --durations=10 tests/gpu
# Two groups per rank (a training and a weight-sync group), SIGTERM; the baseline is the same
# job without the plugin, waiting out a 10 s NCCL timeout.
# shellcheck disable=SC2086  # the *_ARGS are lists of arguments
stage release-nccl 180 python3 -m ray_graceful.tools.cli bench release --backend nccl \
  ${RELEASE_ARGS:---sizes 2,4 --reps 3 --how sigterm --groups 2 --timeout 10} \
  --json "$out/release-nccl.json"
# shellcheck disable=SC2086
stage restart-nccl 150 python3 -m benchmarks restart --backend nccl \
  ${RESTART_ARGS:---ranks 4 --sizes 64 --reps 2 --ways warm,cold-memory} \
  --json "$out/restart-nccl.json"
# shellcheck disable=SC2086
stage abort-variants 120 python3 tests/gpu/abort_variants.py \
  ${ABORT_ARGS:---ranks 3 --reps 2} --json "$out/abort-variants.json"
echo "== all stages done in $((SECONDS - started))s, status $status"
exit "$status"
