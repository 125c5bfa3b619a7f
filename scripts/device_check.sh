#!/usr/bin/env bash
# Everything the lent GPU should run: GPU tests, kernel checks, engine benchmarks, partition
# checks, calibration. Results go to $OUT (default ./out); a short table is printed last.
# Usage: bash scripts/device_check.sh [STEP ...]   (no argument: every step; one call is
# limited to 10 minutes, so split: `tests attention spatial` then `engine calibrate watchdog`;
# `core-tests` is the quick subset: engine vs transformers, spatial vs temporal, fused ops).
# The GPU image has torch/triton/transformers/cuda-bindings but no FastAPI: only GPU-side code runs here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
selected=" $* "
summary=()
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  [ "$selected" = "  " ] || [[ "$selected" == *" $name "* ]] || return 0
  echo "=== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"
  summary+=("$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  bash scripts/tree_id.sh; } | tee "$OUT/env.txt"
step tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_spatial.py \
  tests/test_partition.py tests/test_triton_attention.py tests/test_fused_ops.py tests/test_triton_gemm.py tests/test_calibrate.py tests/test_decode_stream.py tests/test_triton_sampler.py
step core-tests 300 python3 -m pytest -q -rP -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_spatial.py \
  tests/test_partition.py tests/test_fused_ops.py tests/test_triton_gemm.py
step attention 300 python3 scripts/bench_attention.py --out "$OUT/attention.json" ${ATTENTION_ARGS:-}
step gemm 300 python3 scripts/bench_decode_gemm.py --out "$OUT/gemm.json"
step weight-stream 240 python3 scripts/bench_weight_stream.py --out "$OUT/weight_stream.json"
step bulk-copy 120 python3 scripts/bench_bulk_copy.py --out "$OUT/bulk_copy.json"
step decode-stream 300 python3 scripts/bench_decode_stream.py --out "$OUT/decode_stream.json"
step engine 420 python3 scripts/bench_engine.py --iters 10 --variants ${ENGINE_VARIANTS:-graphs,eager} --out "$OUT/engine.json"
step profile 240 python3 scripts/profile_decode.py --out "$OUT/profile.json" ${PROFILE_ARGS:-}
step spatial 300 python3 scripts/bench_spatial.py --out "$OUT/spatial.json"
step calibrate 420 python3 -m duetserve.calibrate --gpu-name h200-lent --out "$OUT/profile_h200.json" --plot "$OUT/calib.png" --quick
step watchdog 300 python3 scripts/tpcmask_watchdog.py --out "$OUT/watchdog.json"
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
