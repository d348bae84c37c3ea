#!/usr/bin/env bash
# The recipe table on one GPU for Llama 3.1 8B shortened to 4 layers (full 8B width, 128K vocabulary, seq 8192):
# bf16, +compile, +float8 (tensorwise), +compile+float8. Under 8 minutes on one H200: one round of 30 steps
# per recipe, medians over steps 6-30, each run capped at 150 s so a hung recipe cannot eat the budget.
# Writes OUT_DIR/results.{md,json,png}, OUT_DIR/device.txt and the runs' metrics under OUT_DIR/runs/.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--section.key value ...]   (default OUT_DIR: outputs/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
OUT=outputs/gpu_check
if [[ $# -gt 0 && $1 != --* ]]; then OUT=$1; shift; fi

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "error: benchmarks/gpu_check.sh needs a CUDA GPU and none is visible to torch; on a CPU compare recipes" \
       "with: python -m titan.compare --recipes baseline,+compile,+float8" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("llama_models") else 1)'; then
  echo "error: the 8B flavor uses the Llama 3 tokenizer from llama-models: pip install -e '.[data]'" >&2
  exit 2
fi

mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.txt" 2>/dev/null || true
"$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())' \
  | tee -a "$OUT/device.txt"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/outputs/.inductor_cache}

"$PYTHON" -m titan.compare --recipes baseline,+compile,+float8,+compile+float8 \
  --steps 30 --warmup 5 --rounds 1 --timeout 150 --out "$OUT" \
  --config configs/titan/llama3_8b.toml --model.n_layers 4 --activation_checkpoint.mode none \
  --training.local_batch_size 1 --training.seq_len 8192 --lr_scheduler.warmup_steps 5 "$@"
