#!/usr/bin/env bash
# Issue #42, item 5: reuse flows under load on one H200 (Qwen3-8B random weights, RAG prompts of
# 8 documents of 4K from a corpus of 64, Zipf 1.0, a warm corpus, 128 output tokens, P95 TTFT SLO 2 s).
# A device call runs 10 minutes at most and the run takes longer, so it is written under $OUT and
# resumed from a copy carried back (cells already measured are not run again).
# Here: carry .whl (pydantic for the host, CPython 3.12). There (repo root):
#   bash benchmarks/reuse_serve_gpu.sh tests            the GPU tests of the served reuse path and the engine
#   bash benchmarks/reuse_serve_gpu.sh smoke            a small reuse run (2 docs of 1K per prompt)
#   bash benchmarks/reuse_serve_gpu.sh run SECONDS      the run, stopped after SECONDS, in $OUT/serve/<run>
#   bash benchmarks/reuse_serve_gpu.sh resume SECONDS   carry the run folder back as .carry/serve/<run> too
#   bash benchmarks/reuse_serve_gpu.sh step             a batched reuse prefill step's profile and floor ($OUT/step.json)
#   bash benchmarks/reuse_serve_gpu.sh grid SECONDS     the run's rates above 3 req/s, in $OUT/grid/<run>
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1
[ -d /tmp/pp/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pp .whl/*.whl
cli() { python3 -m sparsetune.cli.main "$@"; }
case "${1:-}" in
tests) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -m pytest -q -x -m gpu tests/reuse/test_served.py tests/engine/test_gpu.py 2>&1 | tail -6 ;;
smoke) cli bench serve --model qwen3-8b --random-weights --reuse cacheblend --workload rag --docs 8 --per-prompt 2 \
    --doc-len 1024 --requests 4 --rate 4 --output-len 16 --warmup 1 --slo ttft=2000 --out "$OUT/smoke" 2>&1 | tail -16 ;;
run) timeout "${2:-540}" python3 -m sparsetune.cli.main bench serve --model qwen3-8b --random-weights \
    --reuse cacheblend,sparsex,a3 --workload rag --docs 64 --per-prompt 8 --doc-len 4096 --question-len 64 --zipf 1.0 \
    --output-len 128 --slo ttft=2000 --rate 0.25,0.5,1,2,3 --requests 12 --warmup 1 --out "$OUT/serve" 2>&1 | tail -40 ;;
resume) mkdir -p "$OUT/serve" && cp -r .carry/serve/* "$OUT/serve/" && run=$(ls -d "$OUT"/serve/*/ | head -1) &&
    timeout "${2:-560}" python3 -m sparsetune.cli.main bench serve --resume "$run" 2>&1 | tail -40 ;;
step) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 benchmarks/bench_reuse_step.py --model qwen3-8b --flows cacheblend,sparsex,a3 --batches 1,2,4 \
    --kv-memory 80GiB --json-out "$OUT/step.json" 2>&1 | tail -30 ;;
grid) timeout "${2:-540}" python3 -m sparsetune.cli.main bench serve --model qwen3-8b --random-weights \
    --reuse cacheblend,sparsex,a3 --workload rag --docs 64 --per-prompt 8 --doc-len 4096 --question-len 64 --zipf 1.0 \
    --output-len 128 --slo ttft=2000 --rate 4,6,8 --requests 12 --warmup 1 --out "$OUT/grid" 2>&1 | tail -40 ;;
*) echo "usage: $0 tests|smoke|run SECONDS|resume SECONDS|step|grid SECONDS"; exit 2 ;;
esac
