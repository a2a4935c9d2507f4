#!/usr/bin/env bash
# One device call: GPU correctness tests, then the kernel, prefill-attention, engine and small-model benchmarks.
# Usage (on the GPU host, repo root): OUT=/some/dir bash benchmarks/run_gpu.sh [quick]
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -40; }
step tests 150 python3 -m pytest -q -x -p no:warnings tests/test_gpu.py tests/test_kernels.py
step engine 240 python3 benchmarks/bench_engine.py --json-out "$OUT/engine.json"
step prefill_attn 60 python3 benchmarks/bench_prefill_attention.py --seq 32768
step kernels 150 python3 benchmarks/bench_kernels.py --quick --json-out "$OUT/kernels.json"
step small 60 python3 benchmarks/bench_small.py --device cuda --batch 1,8,32 --tokens 128 --json-out "$OUT/small.json"
