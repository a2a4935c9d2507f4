#!/usr/bin/env bash
# One device call: GPU correctness tests, then the engine, prefill-attention, kernel and small-model benchmarks.
# Usage (on the GPU host, repo root): OUT=/some/dir bash benchmarks/run_gpu.sh [steps...]
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${*:-"tests engine prefill_attn kernels small"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
step() { local name=$1 limit=$2; shift 2; [[ " $STEPS " == *" $name "* ]] || return 0
  echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -30; }
step oob 150 bash -c 'for c in "8 32768" "16 16384" "16 32768" "64 4096"; do set -- $c; CUDA_LAUNCH_BLOCKING=1 python3 benchmarks/debug_decode_oob.py --batch $1 --ctx $2 --check 2>&1 | tail -3; done; compute-sanitizer --tool memcheck --print-limit 5 python3 benchmarks/debug_decode_oob.py --batch 16 --ctx 2048 2>&1 | tail -25'
step tests 300 python3 -m pytest -q -x tests/engine/test_gpu.py tests/kernels/test_kernels.py tests/flow/test_indexer_kernels.py
step engine 240 python3 benchmarks/bench_engine.py --json-out "$OUT/engine.json"
step prefill_attn 60 python3 benchmarks/bench_prefill_attention.py --seq 32768
step kernels 150 python3 benchmarks/bench_kernels.py --quick --json-out "$OUT/kernels.json"
step small 60 python3 benchmarks/bench_small.py --device cuda --batch 1,8,32 --tokens 128 --json-out "$OUT/small.json"
# Issue #18 (opt-in: `bash benchmarks/run_gpu.sh rows_tests rows_bench reuse`): the row kernels compiled for
# real against float64, then timed alone, then inside the reuse prefill at 32K both ways in one run.
step rows_tests 300 python3 -m pytest -q -x tests/kernels/test_rows_attention.py
step rows_bench 240 python3 benchmarks/bench_rows_attention.py --json-out "$OUT/rows.json"
step reuse 560 bash -c 'python3 -c "import json, torch; torch.manual_seed(0); json.dump({\"scores\": torch.rand(36, 8).tolist()}, open(\"/tmp/heads-8b.json\", \"w\"))" &&
  python3 benchmarks/bench_reuse.py --model qwen3-8b --context 32768 --repeats 3 --rows torch,kernels \
    --flows full_recompute,pie,cacheblend,sparsex,a3,redknot,loopserve --param redknot:head_classes=/tmp/heads-8b.json \
    --json-out "$OUT/reuse.json"'
# Issue #17 (opt-in: `bash benchmarks/run_gpu.sh sparse_blocks engine_blocks`): the sparse decode kernel at
# selection blocks of 2-16 tokens (2048 tokens selected; splits swept to 4x the automatic count, the
# batch-8 lead), then the engine's sparse step at those block sizes (every sparse layer selecting).
step sparse_blocks 400 python3 benchmarks/bench_kernels.py --quick --skip-large --sparse-block-sizes 2,4,8,16 \
  --json-out "$OUT/sparse_blocks.json"
step engine_blocks 560 bash -c 'for bs in 2 4 8; do python3 benchmarks/bench_engine.py --model qwen3-8b \
  --flows dense,block_topk,quest --param budget=2048 --param dense_layers=0 --param block_size=$bs \
  --decode 16x32768,8x32768 --prefill "" --profile "" --profile-prefill 0 --json-out "$OUT/engine_bs$bs.json"; done'
# The top-k alone at blocks 4-16 (each block size compiles eight variants: ~2 minutes a size).
step topk_sweep 400 python3 benchmarks/bench_indexer.py --topk-block-sizes 4,8,16 --json-out "$OUT/topk.json"
# Reuse accuracy on the row kernels (#18 acceptance): first call (carry .carry/ga) `bash benchmarks/agent_hour.sh
# place`; next (carry .carry/gb .carry/wheels) `bash benchmarks/agent_hour.sh model && PYTHONPATH=/tmp/pp TASKS=rag
# bash benchmarks/run_gpu.sh reuse_acc`. TASKS picks the tables (rag, chat, agent: ~200 s each).
step reuse_acc 580 bash -c 'python3 -m sparsetune.cli.main flows profile-heads --device cuda && for task in ${TASKS:-rag}; do
  python3 benchmarks/reuse_table.py --task $task --contexts 2048,4096 --samples 20 --device cuda \
    --flows full_recompute,sparsex,a3,cacheblend,epic,pie,naive_reuse,redknot,loopserve --json-out "$OUT/acc_$task.json"; done'
