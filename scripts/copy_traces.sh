#!/usr/bin/env bash
# Copy the traces the serving benchmark replays (Azure code and conversation CSVs, Mooncake
# conversation JSONL) from ../shared/traces into .traces/ (ignored by git), so that a device call that
# names `.traces` in `carry` has them (../shared does not travel). About 4 MB.
# Usage: bash scripts/copy_traces.sh [TRACES_DIR]   (default: ../shared/traces beside the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-${DUETSERVE_TRACES:-../shared/traces}}
[ -d "$src" ] || src=/work/shared/traces
mkdir -p .traces
for f in AzureLLMInferenceTrace_code.csv AzureLLMInferenceTrace_conv.csv mooncake_conversation_trace.jsonl; do
  cp -f "$src/$f" .traces/ && chmod u+w ".traces/$f"
done
grep -qxF '/.traces/' .gitignore || echo '/.traces/' >> .gitignore
(cd .traces && sha256sum AzureLLMInferenceTrace_code.csv AzureLLMInferenceTrace_conv.csv mooncake_conversation_trace.jsonl)
du -sh .traces
