#!/usr/bin/env bash
# Issue 6 "Serving": the HTTP serving benchmark on the lent GPU in ONE device call (~9 min).
# Policies duet, chunked, prefill-first, pdmux, one server each; Qwen3-8B shapes with dummy
# bf16 weights (a --model folder with config.json and a synthetic word-level tokenizer, written
# at run time); TBT SLO 100 ms; Poisson replays (the simulator's setting) of the first
# ceil(QPS x SECONDS) requests of the Azure code trace (QPS 10 and 16, 10 s of arrivals) and of
# the Mooncake conversation trace (QPS 1.5 and 3, 12 s; inputs capped at 32k tokens so
# prompt + output fit the config's 40,960-token context, outputs at 1024 to bound the drain):
# loads where `duetserve simulate` with these very settings puts chunked past the SLO and duet
# within it (docs/benchmarks.md, "Next: serving on the GPU").
# KV cache: 0.9 of the free memory after 16.4 GB of weights is about 800k tokens (144 KiB a
# token), more than 24 running sequences of <= 33k tokens each (256 may run: long ones wait for blocks).
# Time: per configuration server start (weights drawn on the CPU: expect 30-60 s) + warm-up +
# 4 runs; each configuration gets an equal slice of what its lane (GPU) has left and runs that
# cannot fit are skipped (and listed as such), so the call ends inside its 600 s whatever the
# start-up costs.
#
# Before the call, here:  bash scripts/fetch_device_wheels.sh && bash scripts/copy_traces.sh
# Device call:  run(command="bash scripts/device_serving.sh", carry=[".whl", ".traces"], timeout_s=600)
# Results under $OUT (6 files): serving.json, serving_table.md, serving.log,
# serving_azure_code.png, serving_mooncake.png, iterations.jsonl.gz.
#
# Knobs (env): SERVING_POLICIES (may be empty to run only variants), SERVING_AZURE
# ("QPS,QPS:SECONDS"), SERVING_AZURE_CONV (the same for the Azure conversation trace), SERVING_MOONCAKE
# ("QPS,QPS:SECONDS:MAX_INPUT:MAX_OUTPUT"), SERVING_TRACES ("azure_code mooncake" by default; also
# azure_conv), SERVING_BUDGET_S (internal deadline, default 510; each GPU lane has
# all of it), SERVING_SERVE_ARGS (extra serve flags, every configuration),
# SERVING_VARIANTS (more configurations, ';'-separated LABEL=SERVE_ARGS each, SERVE_ARGS with
# its own --policy, e.g. "duet-trim=--policy duet --trim-margin 0.85;chunked-2048=--policy
# chunked --max-num-batched-tokens 2048"; LABEL names it in the table, JSON, plots and logs),
# SERVING_GPUS (lanes run in parallel, default: the GPUs `nvidia-smi -L` lists, 1 in CPU mode
# or without any: configuration j (policies first, then variants) runs on GPU j % N, port
# 8123 + j % N, the lane's configurations one after another), SERVING_BENCH_ARGS (extra
# serving_bench.py flags, e.g. "--request-timeout-s 120 --drain-estimate-s 40" for long windows).
# SERVING_CPU=1: smoke run on the CPU (tiny Qwen3, --device cpu, duet+chunked, tiny windows;
# with SERVING_GPUS=2 two servers run at once on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
LOG=$OUT/serving.log
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
echo "=== device_serving.sh $(date -u +%FT%TZ) on $(hostname)"

# 1. the FastAPI stack the GPU image lacks, from carried wheels (scripts/fetch_device_wheels.sh)
if ls .whl/*.whl > /dev/null 2>&1 && { [ "${SERVING_FORCE_WHEELS:-0}" = 1 ] || \
    ! python3 -c 'import fastapi, uvicorn, pydantic, prometheus_client, orjson' 2> /dev/null; }; then
  SITE=${SERVING_SITE:-/tmp/site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  opt=$(python3 scripts/select_wheels.py "$SITE" .whl/opt prometheus-client) || exit 1
  echo "image packages kept; carried in addition: ${opt:-none}"
  if [ -n "$opt" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $opt \
      || { echo "optional wheel install failed"; exit 1; }
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import fastapi, uvicorn, pydantic, prometheus_client, httpx, orjson; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)' \
  || { echo "the server stack does not import: run scripts/fetch_device_wheels.sh and carry .whl"; exit 1; }
ls .traces/AzureLLMInferenceTrace_code.csv .traces/AzureLLMInferenceTrace_conv.csv .traces/mooncake_conversation_trace.jsonl > /dev/null \
  || { echo "no traces: run scripts/copy_traces.sh and carry .traces"; exit 1; }
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader

# 2. the benchmark
if [ "${SERVING_CPU:-0}" = 1 ]; then
  defaults=(--model-config tiny --device cpu --policies "${SERVING_POLICIES-duet,chunked}"
            --warmup-requests 2 --warmup-input-len 64:256 --warmup-output-len 4 --request-timeout-s 30
            --launch-timeout-s 120)
  azure=${SERVING_AZURE:-2:3:512}; mooncake=${SERVING_MOONCAKE:-1:3:512:64}; budget=${SERVING_BUDGET_S:-150}
  azure_conv=${SERVING_AZURE_CONV:-2:3:512}
else
  defaults=(--model-config qwen3-8b --policies "${SERVING_POLICIES-duet,chunked,prefill-first,pdmux}")
  azure=${SERVING_AZURE:-10,16:10}; mooncake=${SERVING_MOONCAKE:-1.5,3:12:32768:1024}; budget=${SERVING_BUDGET_S:-510}
  azure_conv=${SERVING_AZURE_CONV:-16,20:10}
fi
if [ "${SERVING_CPU:-0}" = 1 ]; then gpus=1; else gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU'); fi
gpus=${SERVING_GPUS:-$gpus}; [ "$gpus" -ge 1 ] 2> /dev/null || gpus=1
variants=()
IFS=';' read -ra specs <<< "${SERVING_VARIANTS:-}"
for v in ${specs[@]+"${specs[@]}"}; do
  [ -n "${v//[[:space:]]/}" ] && variants+=(--variant "$v")
done
traces=()
for t in ${SERVING_TRACES:-azure_code mooncake}; do
  case $t in azure_code) traces+=(--trace "azure_code:$azure") ;; mooncake) traces+=(--trace "mooncake:$mooncake") ;;
    azure_conv) traces+=(--trace "azure_conv:$azure_conv") ;; *) echo "unknown trace $t in SERVING_TRACES"; exit 2 ;; esac
done
work=$(mktemp -d /tmp/duetserve-serving.XXXX)
# outer bound: the internal deadline plus the last run's drain and the plots
timeout -k 10 $((budget + 50)) python3 scripts/serving_bench.py --out "$OUT" --work "$work" \
  --deadline-s "$budget" --gpus "$gpus" "${defaults[@]}" ${variants[@]+"${variants[@]}"} "${traces[@]}" \
  ${SERVING_SERVE_ARGS:+--serve-args "$SERVING_SERVE_ARGS"} ${SERVING_BENCH_ARGS:-}
rc=$?
for f in "$work"/server_*.log; do  # server logs into the one log (uvicorn access lines dropped)
  [ -f "$f" ] || continue
  echo "=== $(basename "$f")"; grep -v '"POST /v1/completions HTTP' "$f" | tail -n 150
done
echo "=== serving_bench.py rc=$rc; files under $OUT:"; ls -la "$OUT"
exec 1>&- 2>&-; wait "$TEE_PID"  # serving.log complete before $OUT is collected
exit $rc
