#!/usr/bin/env bash
# One FSDP2 bf16 step of a Wan 1.3B-shaped transformer on this machine's GPUs: tokens/s and MFU.
#   scripts/gpu_check.sh            one process per GPU (torchrun), real sizes
#   scripts/gpu_check.sh --dry      CPU, one process, 1 layer: checks the path runs (no GPU needed)
# Extra arguments go to scripts/gpu_check.py (see --help), e.g. --batch 2 --no-ac --compile.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ " $* " == *" --dry "* ]]; then
    exec "$PY" scripts/gpu_check.py "$@"
fi
GPUS=${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
if [[ "$GPUS" -lt 1 ]]; then
    echo "no CUDA GPU visible; run scripts/gpu_check.sh --dry for the CPU dry run" >&2
    exit 2
fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" scripts/gpu_check.py "$@"
