#!/usr/bin/env bash
# Download the public request traces into DIR (default: traces/data) and verify them.
set -euo pipefail
dir=${1:-"$(dirname "$0")/data"}
mkdir -p "$dir"
azure=https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data
mooncake=https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces
fetch() {  # url name sha256
  curl -fsSL "$1" -o "$dir/$2"
  echo "$3  $dir/$2" | sha256sum -c -
}
fetch "$azure/AzureLLMInferenceTrace_code.csv" AzureLLMInferenceTrace_code.csv \
  54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6
fetch "$azure/AzureLLMInferenceTrace_conv.csv" AzureLLMInferenceTrace_conv.csv \
  2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8
fetch "$mooncake/conversation_trace.jsonl" mooncake_conversation_trace.jsonl \
  b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df
fetch "$mooncake/synthetic_trace.jsonl" mooncake_synthetic_trace.jsonl \
  bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131
