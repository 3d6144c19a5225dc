#!/usr/bin/env bash
# One device call, prioritized steps under one deadline (a session gets ~15 minutes of device time: one call).
# Each step runs under `timeout` with what is left of the budget, so a slow or hung step costs only itself and
# the last step always packs what exists into $OUT/session.tar.gz (the tool returns at most 8 files).
#
#   run(command="source .devgpu/setup.sh && bash bench/device_call.sh 560", carry=[".devgpu"], timeout_s=600)
#
# Steps (edit per session, most important first): the TMA wgmma GPU tests, the GEMM tile sweep, then zoo rows.
set -u
BUDGET=${1:-560}
OUT=${OUT:?OUT must name the folder that comes back}
START=$(date +%s)
WORK=/tmp/ortfuse-call
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 ORTFUSE_CACHE_DIR=$WORK/cache
LOG=$OUT/steps.log

left() { echo $(( BUDGET - 25 - ($(date +%s) - START) )); }  # 25 s kept for packing

step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local t; t=$(left); (( t < max )) && max=$t
  if (( max < 20 )); then echo "== $name: skipped, ${max}s left" | tee -a "$LOG"; return; fi
  echo "== $name (limit ${max}s) $(date +%T)" | tee -a "$LOG"
  local s; s=$(date +%s)
  timeout -k 5 "$max" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $(( $(date +%s) - s ))s" | tee -a "$LOG"
  tail -n 15 "$WORK/$name.log" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee -a "$LOG"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$WORK/install.log" 2>&1 \
  || { cat "$WORK/install.log" >>"$LOG"; exit 1; }

TO=(); python3 -c "import pytest_timeout" 2>/dev/null && TO=(--timeout 60)  # a hung kernel fails one test
step wgmma-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
  --junitxml="$WORK/pytest-wgmma.xml" tests/runtime/test_gpu_wgmma.py
step sweep 170 python3 -m ortfuse.bench.sweep --per-family 4 --json "$WORK/sweep.json" --md "$WORK/sweep.md"
step bert-wgmma 210 python3 -m ortfuse.bench.gpu_suite "$WORK/bert" --no-tests --wgmma --kernels \
  --models bert --dtypes fp16 --work "$WORK/bert-work" --variants ort,ort+cudagraph,ort-transformers,ortfuse,ortfuse+cudagraph
step mobilenetv2-fp16 200 python3 -m ortfuse.bench.gpu_suite "$WORK/mnv2" --no-tests \
  --models mobilenetv2 --dtypes fp16 --work "$WORK/mnv2-work" --variants ort,ort+cudagraph,ortfuse,ortfuse+cudagraph
step convnext-fp32 200 python3 -m ortfuse.bench.gpu_suite "$WORK/cnx" --no-tests \
  --models convnext_t --dtypes fp32 --work "$WORK/cnx-work" --variants ort,ort+cudagraph,ortfuse,ortfuse+cudagraph

cp "$WORK"/sweep.md "$OUT"/ 2>/dev/null
cp "$WORK"/bert/results.md "$OUT"/bert-results.md 2>/dev/null
tar -czf "$OUT/session.tar.gz" -C "$WORK" --exclude=cache --exclude='*.onnx' --exclude='*.onnx.data' . 2>>"$LOG"
ls -la "$OUT" | tee -a "$LOG"
