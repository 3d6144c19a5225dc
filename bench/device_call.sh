#!/usr/bin/env bash
# One device call, prioritized steps under one deadline (a session gets ~15 minutes of device time: one call).
# Each step runs under `timeout` with what is left of the budget, so a slow or hung step costs only itself and
# the last step always packs what exists into $OUT/session.tar.gz (the tool returns at most 8 files).
#
#   run(command="source .devgpu/setup.sh && bash bench/device_call.sh 560 wgmma-tests sweep bert-wgmma",
#       carry=[".devgpu"], timeout_s=600)
#
# Steps run in the order named (most important first); the case below lists them.
set -u
BUDGET=${1:?seconds}; shift
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

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
TO=(); python3 -c "import pytest_timeout" 2>/dev/null && TO=(--timeout 120)  # a hung kernel fails one test
BASE=(--variants ort,ort+cudagraph,ortfuse,ortfuse+cudagraph)
for name in "$@"; do
  case $name in
    gpu-tests)  # every GPU test (`-m gpu`), on 8 worker processes (the image has pytest-xdist and pytest-timeout)
      step "$name" 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
        --junitxml="$WORK/pytest-gpu.xml" tests ;;
    row-tests) step "$name" 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
                 --junitxml="$WORK/pytest-row.xml" tests/runtime/test_gpu_row_cluster.py ;;
    new-tests)  # CPU-only work of sessions 14-17 and 19 on hardware: kernel variants by size, epi8 through the
      # wgmma tests, the attention kernel of session 16 (keys split across clusters at small batches) in the tiny
      # zoo models and under CUDA graph replay, session 17's row-wise epilogue (gathered slots, row_in8),
      # session 19's grouped-query attention, tiny Llama, and op-by-op fp16 chains into integer Casts
      step "$name" 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
        --junitxml="$WORK/pytest-new.xml" tests/runtime/test_gpu_variants.py tests/runtime/test_gpu_wgmma.py \
        tests/runtime/test_gpu_kernels.py tests/runtime/test_gpu_row_cluster.py \
        -k "(variant or wgmma or zoo_tiny or attention or row or integer_cast) and not (multicast or pingpong or odd_pairs)" ;;
    tma-tests)  # session 18 (CPU only): the TMA mainloops with B multicast and ping-pong warpgroups
      step "$name" 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
        --junitxml="$WORK/pytest-tma.xml" tests/runtime/test_gpu_wgmma.py -k "multicast or pingpong or odd_pairs" ;;
    wgmma-tests) step "$name" 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short "${TO[@]}" \
                   --junitxml="$WORK/pytest-wgmma.xml" tests/runtime/test_gpu_wgmma.py ;;
    sweep) step "$name" 170 python3 -m ortfuse.bench.sweep --per-family 4 --json "$WORK/sweep.json" --md "$WORK/sweep.md" ;;
    sweep-rest) step "$name" 150 python3 -m ortfuse.bench.sweep --per-family 3 --json "$WORK/sweep-rest.json" \
                  --md "$WORK/sweep-rest.md" --shapes 4096x768x3072 4096x2304x768 128x768x768 128x3072x768 128x768x3072 ;;
    sweep-gelu|sweep-softsign)  # issue 5, 2026-11-26 (CPU session 15): an epilogue's cost on several tiles, cuBLAS +
      # the epilogue as our kernel beside it: GELU (branch-free since the reciprocal) and softsign (an IEEE
      # division's per-element branch), the data behind Target.epilogue_branch_clocks (one shape so far)
      step "$name" 120 python3 -m ortfuse.bench.sweep --epilogue "${name#sweep-}" --per-family 2 \
        --json "$WORK/$name.json" --md "$WORK/$name.md" --shapes 4096x3072x768 128x3072x768 ;;
    sweep-layernorm)  # issue 5, 2026-11-26 (CPU session 17): GEMM + bias + residual + LayerNorm as one kernel (split
      # across a cluster, or spanning the row) against cuBLAS + our row kernel, and without its row pass
      # (--ablate): what session 17's row epilogue (gathered slots, unrolled rows, row_in8) left of the 3x
      step "$name" 150 python3 -m ortfuse.bench.sweep --epilogue layernorm --per-family 2 --ablate \
        --json "$WORK/$name.json" --md "$WORK/$name.md" --shapes 4096x768x768 128x768x768 4096x768x3072 128x768x3072 ;;
    sweep-diag)  # issue 5, 2026-11-26: where the fixed ~18 us per 4096x768 output goes (M scaling, no stores, warm L2)
      step "$name" 200 python3 -m ortfuse.bench.sweep --per-family 1 --ablate --no-flush --json "$WORK/sweep-diag.json" \
        --md "$WORK/sweep-diag.md" --shapes 1024x768x768 2048x768x768 4096x768x768 8192x768x768 4096x768x3072 ;;
    groupnorm)  # 2026-11-27 (session 25, CPU only): GroupNorm + SiLU as one row kernel at a UNet's latent sizes and
      # PoolFormer's one group, `--profile` against ORT's InstanceNormalization + 4 element-wise kernels, the
      # cost model's few-rows estimate (CostModel.few_rows_us, assumed) beside each measurement
      step "$name" 90 python3 -m ortfuse.bench.groupnorm --batch 8 ;;
    sweep-gated)  # 2026-11-26 (session 23): Llama's gated MLP as one GEMM (gate and up interleaved) on each
      # family's best tiles, against cuBLAS alone on the packed weight and cuBLAS + the gated element-wise kernel
      step "$name" 120 python3 -m ortfuse.bench.sweep --epilogue gated --per-family 2 \
        --json "$WORK/$name.json" --md "$WORK/$name.md" --shapes 4096x3072x576 128x3072x576 ;;
    sweep-unaligned)  # 2026-11-26 (session 20): GPT-2's LM head (N = 50,257) as ORT runs it and padded to 16-byte
      # rows (rewriter.gemm_padding): the measurement behind Target.unaligned_gemm_slowdown (so far inferred);
      # then our GEMM + bias on it (the TMA family reads the weight transposed offline) against cuBLAS, each
      # family's best tile also with the fragment stores it had before its rows were staged (--direct-stores):
      # the measurement behind Target.staged_store_factor (so far assumed), against the same GEMM padded to
      # aligned rows (the summary's "misaligned" lines)
      step "$name" 200 bash -c "python3 -m ortfuse.bench.unaligned --json $WORK/unaligned.json --md $WORK/sweep-unaligned.md &&
        python3 -m ortfuse.bench.sweep --per-family 1 --direct-stores \
          --shapes 4096x50257x768 4096x50264x768 128x50257x768 128x50264x768 \
          --json $WORK/sweep-unaligned-ours.json --md $WORK/sweep-unaligned-ours.md" ;;
    ncu)  # issue 5: where our GEMM's time goes next to cuBLAS's (bench/ncu_gemm.py): every family's best tile,
      # one run each (the 8 kernels profiled cover all six: why B multicast loses 2-3x and ping-pong does not win)
      step "$name" 120 "$NCU" --clock-control none -k 'regex:ofz_[0-9a-f]{10}$|nvjet|gemm|xmma' -c 8 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        python3 -m ortfuse.bench.ncu_gemm 4096x3072x768 --runs 1 ;;
    ncu-source)  # the same for 4096x768x768, with per-instruction stall sampling (which wait: mbarrier, store, load)
      step "$name" 120 "$NCU" --clock-control none -k 'regex:ofz_[0-9a-f]{10}$|nvjet|gemm|xmma' -c 4 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        python3 -m ortfuse.bench.ncu_gemm 4096x768x768 --runs 1 ;;
    ncu-attention|ncu-attention-*)  # issue 5: our attention kernel next to ORT's MultiHeadAttention, with stall
      # sampling; ncu-attention-MODEL-DTYPE-BATCH (default bert-fp16-32), e.g. ncu-attention-llama_decode-fp16-1:
      # session 31's timeline put a key tile at ~6-7 us for a lone block (18 us a decode step)
      spec=${name#ncu-attention}; spec=${spec#-}; [[ -z $spec ]] && spec=bert-fp16-32
      IFS=- read -r am ad ab <<<"$spec"
      step "$name" 150 "$NCU" --clock-control none -k 'regex:ofz_[0-9a-f]{10}$|fmha|flash|[Aa]ttention|cutlass' -c 4 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        python3 -m ortfuse.bench.ncu_attention "$am" "${ad:-fp16}" --batch "${ab:-32}" --runs 1 ;;
    bert-wgmma) step "$name" 210 python3 -m ortfuse.bench.gpu_suite "$WORK/bert" --no-tests --wgmma --kernels \
                  --models bert --dtypes fp16 --work "$WORK/bert-work" --variants ort,ort+cudagraph,ort-transformers,ortfuse,ortfuse+cudagraph ;;
    suite-*)  # suite-MODEL-DTYPE[-kernels|-nowgmma|-noprofile|-lnfoldoff|-pdl|-layout|-blocks|-mhaon|-mhaoff|-kropeonce|-kropekernel|-nofrontier|-baselines|-ortopt]: one zoo row with
      # --profile (wgmma is the sm_90 default; -kernels adds the per-kernel table, -nowgmma optimizes without
      # wgmma, -noprofile without --profile: the default build; -lnfoldoff the default build with --ln-fold off;
      # -pdl the default build with a --pdl build timed beside it in the same run; -layout the default build
      # with a --layout model build (residual streams left in the model's layout) beside it; -blocks the same with
      # a --layout blocks build (every stream kept in its blocks' layout where it can be); -mhaon / -mhaoff the same
      # with an --ort-attention on / off build (attention as ORT's MultiHeadAttention wherever it can be / never);
      # -kropeonce / -kropekernel the same with a --k-rope once / kernel build (K's rotary embedding before the
      # attention kernel / in it); -nofrontier the same with a build whose attention kernels visit every key
      # tile (no causal frontier: ORTFUSE_KEY_FRONTIER=0);
      # -baselines the default build beside every baseline, ORT's transformers optimizer and torch.compile
      # included, all in one process; -ortopt the default build beside ORT's transformers optimizer's model and
      # ortfuse applied to that model (session 35: ORT's fused ops written as standard ops), e.g. suite-vit-fp16-kernels
      IFS=- read -r _ model dtype extra <<<"$name"
      flags=(); variants=("${BASE[@]}")
      [[ $extra == kernels ]] && flags=(--kernels); [[ $extra == nowgmma ]] && flags=(--no-wgmma)
      [[ $extra == noprofile ]] && flags=(--no-profile)
      [[ $extra == lnfoldoff ]] && flags=(--no-profile --ln-fold off)
      [[ $extra == pdl ]] && flags=(--no-profile --beside-pdl)
      [[ $extra == layout ]] && flags=(--no-profile --beside-layout model)
      [[ $extra == blocks ]] && flags=(--no-profile --beside-layout blocks)
      [[ $extra == mhaon ]] && flags=(--no-profile --beside-ort-attention on)
      [[ $extra == mhaoff ]] && flags=(--no-profile --beside-ort-attention off)
      [[ $extra == kropeonce ]] && flags=(--no-profile --beside-k-rope once)
      [[ $extra == kropekernel ]] && flags=(--no-profile --beside-k-rope kernel)
      [[ $extra == nofrontier ]] && flags=(--no-profile --beside-no-key-frontier)
      [[ $extra == baselines ]] && flags=(--no-profile) && variants=()
      [[ $extra == ortopt ]] && flags=(--no-profile) && variants=(--variants ort,ort-transformers,ort-transformers+ortfuse,ortfuse)
      step "$name" 300 python3 -m ortfuse.bench.gpu_suite "$WORK/$name" --no-tests "${flags[@]}" --models "$model" \
        --dtypes "$dtype" --work "$WORK/$name-work" "${variants[@]}" ;;
    mem-*)  # mem-MODEL-DTYPE: peak memory at batch 32 with every CUDA arena grown by what is asked
      # (ORTFUSE_BENCH_ARENA=same, bench/harness.py) for stock ORT, the default build and an --ort-attention on
      # build beside it: session 51's ViT fp32 2,176 MB against ORT's 1,288, a doubling of the arena or not
      IFS=- read -r _ model dtype <<<"$name"
      step "$name" 150 env ORTFUSE_BENCH_ARENA=same python3 -m ortfuse.bench.gpu_suite "$WORK/$name" --no-tests \
        --no-profile --beside-ort-attention on --models "$model" --dtypes "$dtype" --batches 32 \
        --work "$WORK/$name-work" --variants ort,ortfuse ;;
    mobilenetv2-fp16) step "$name" 200 python3 -m ortfuse.bench.gpu_suite "$WORK/mnv2" --no-tests \
                        --models mobilenetv2 --dtypes fp16 --work "$WORK/mnv2-work" "${BASE[@]}" ;;
    fp32-rows)  # issue 4's fp32 rows, the default build, model after model (the report keeps what finished)
      step "$name" 600 python3 -m ortfuse.bench.gpu_suite "$WORK/fp32" --no-tests --no-profile --dtypes fp32 \
        --models bert gpt2 vit resnet50 mobilenetv2 llama llama_decode convnext_t --work "$WORK/fp32-work" "${BASE[@]}" ;;
    fp32-rest)  # the fp32 rows session 30's call did not reach (BERT, GPT-2 and ViT are in docs/results.md)
      step "$name" 600 python3 -m ortfuse.bench.gpu_suite "$WORK/fp32-rest" --no-tests --no-profile --dtypes fp32 \
        --models resnet50 mobilenetv2 convnext_t llama_decode llama --work "$WORK/fp32-rest-work" "${BASE[@]}" ;;
    convnext-fp32) step "$name" 200 python3 -m ortfuse.bench.gpu_suite "$WORK/cnx" --no-tests \
                     --models convnext_t --dtypes fp32 --work "$WORK/cnx-work" "${BASE[@]}" ;;
    shipped)  # the trained models from PyPI wheels: a warm call after one that carried .devgpu, carrying
      # [".zoo-wheels"] alone (bench/README "GPU suite" fills it here; .devgpu stays on the machine)
      step "$name" 300 python3 -m ortfuse.bench.gpu_suite "$WORK/shipped" --no-tests --wheels .zoo-wheels \
        --models ppocr_det ppocr_rec magika --work "$WORK/shipped-work" "${BASE[@]}" ;;
    timeline-*)  # timeline-MODEL-DTYPE[-BATCH[-mha]]: one inference kernel by kernel (bench/timeline.py; batch 1
      # unless given; -mha needs the batch): stock ORT, the default build and beside it a --pdl build (-mha: an
      # --ort-attention on build, session 51's fp32 attention question), with and without CUDA graphs (kernel
      # time, gaps, overlap)
      IFS=- read -r _ model dtype tbatch textra <<<"$name"
      bflag=--pdl; [[ $textra == mha ]] && bflag="--ort-attention on"
      step "$name" 240 bash -c "M=\$(python3 -c \"from ortfuse.bench import zoo; print(zoo.build('$model', '$dtype', False))\" | tail -1) &&
        H=\$(python3 -c \"import onnx, sys; from ortfuse.bench import zoo; m = onnx.load(sys.argv[1], load_external_data=False); print(' '.join(f'--dim-hint {n}={v}' for n, v in zoo.dim_hints(m, zoo.read_sidecar(sys.argv[1]))))\" \$M) &&
        python3 -m ortfuse optimize \$M $WORK/$name.onnx \$H >/dev/null && python3 -m ortfuse optimize \$M $WORK/$name.beside.onnx $bflag \$H >/dev/null &&
        python3 -m ortfuse.bench.timeline \$M --optimized $WORK/$name.onnx --beside $WORK/$name.beside.onnx --batch ${tbatch:-1} --md $WORK/$name.md --json $WORK/$name.json" ;;
    trace-*)  # trace-MODEL-DTYPE: where the default build's values first part from stock ORT's on the GPU
      # (`ortfuse check --trace`: every tensor both models compute, bit for bit, on the suite's parity inputs,
      # batch 2); session 51 found BERT QDQ's parity failing on the GPU alone (bit-exact on the CPU)
      IFS=- read -r _ model dtype <<<"$name"
      step "$name" 240 bash -c "M=\$(python3 -c \"from ortfuse.bench import zoo; print(zoo.build('$model', '$dtype', False))\" | tail -1) &&
        H=\$(python3 -c \"import onnx, sys; from ortfuse.bench import zoo; m = onnx.load(sys.argv[1], load_external_data=False); print(' '.join(f'--dim-hint {n}={v}' for n, v in zoo.dim_hints(m, zoo.read_sidecar(sys.argv[1]))))\" \$M) &&
        S=\$(python3 -c \"import onnx, sys; from ortfuse.bench import harness, zoo; f = harness.make_feeds(onnx.load(sys.argv[1]), batch=2, meta=zoo.read_sidecar(sys.argv[1])); print(' '.join(f'--input-shape {k}:' + 'x'.join(map(str, v.shape)) for k, v in f.items()))\" \$M) &&
        python3 -m ortfuse optimize \$M $WORK/$name.onnx \$H >/dev/null &&
        { python3 -m ortfuse check \$M $WORK/$name.onnx --provider cuda --trace \$S > $WORK/$name.md 2>&1; r=\$?; cat $WORK/$name.md; exit \$r; }" ;;
    torch-compile-*)  # torch-compile-MODEL-DTYPE: the torch.compile baseline beside stock ORT (no --profile optimize)
      IFS=- read -r _ _ model dtype <<<"$name"
      step "$name" 300 bash -c "M=\$(python3 -c \"from ortfuse.bench import zoo; print(zoo.build('$model', '$dtype', False))\" | tail -1) &&
        python3 -m ortfuse.bench.harness \$M --provider cuda --batch 1,32 --variants ort,torch.compile --out $WORK/$name" ;;
    *) echo "== unknown step $name" | tee -a "$LOG" ;;
  esac
done

cp "$WORK"/sweep*.md "$WORK"/timeline*.md "$WORK"/trace*.md "$OUT"/ 2>/dev/null
cp "$WORK"/bert/results.md "$OUT"/bert-results.md 2>/dev/null
tar -czf "$OUT/session.tar.gz" -C "$WORK" --exclude=cache --exclude='*.onnx' --exclude='*.onnx.data' . 2>>"$LOG"
ls -la "$OUT" | tee -a "$LOG"
