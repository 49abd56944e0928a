#!/usr/bin/env bash
# Memory and speed on one GPU: one table of tokens/s, MFU and peak memory per attention backend,
# with/without activation checkpointing and compile (Wan 1.3B shape, 32,760 tokens), fp8 training
# against bf16 (14B widths), LoRA on fp8 against bf16 base weights; and `vt-train run` itself under torchrun
# on every GPU at real size (Wan 2.1 14B and HunyuanVideo 1.5 LoRA with validation, random-weight real
# configs: measured peak beside the plan, step time, MFU; the 14B LoRA again under a 24 GiB cap with block swap and
# activation offload, and with an NF4 base and activation offload: start-up peak, page-locked and peak host memory
# beside the plan's). See scripts/gpu_check.py, scripts/gpu_real_run.py.
#   scripts/gpu_check.sh              first GPU (CUDA_VISIBLE_DEVICES picks another), real sizes
#   scripts/gpu_check.sh --dry        CPU, tiny shapes, one step per row: checks every row's path runs
# Extra arguments go to scripts/gpu_check.py (see --help), e.g. --only fp8 --json runs/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ " $* " != *" --dry "* ]] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "no CUDA GPU visible; run scripts/gpu_check.sh --dry for the CPU dry run" >&2
    exit 2
fi
"$PY" -m vt.train env 2>/dev/null || true  # the machine, for the record above the table
exec "$PY" scripts/gpu_check.py "$@"
