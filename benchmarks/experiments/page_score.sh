#!/usr/bin/env bash
# Issue #43 experiment: cheaper page scores for two-level flows (double_sparse_2l, benchmarks/experiments/sub4*_2l.py),
# speed on Qwen3-8B shapes beside dense, accuracy on the embedded model, one lease.
# There (device tool), one machine, one call each:
#   carry .carry/ga:      bash benchmarks/agent_hour.sh place
#   carry .carry/wheels:  bash benchmarks/agent_hour.sh wheels && bash benchmarks/experiments/page_score.sh speed [POINTS]
#   carry .carry/gb:      bash benchmarks/agent_hour.sh model && bash benchmarks/experiments/page_score.sh acc [CONTEXT] [FLOW,k=v ...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1 SPARSETUNE_TRUST_FLOW_CODE=1
ST="python3 -m sparsetune.cli.main"
E=benchmarks/experiments
case "${1:-}" in
speed)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pp /tmp/whl/*.whl || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    $ST flows calibrate --model qwen3-8b --random-weights --tokens 1024 > /dev/null || exit 1
    python3 benchmarks/bench_costs.py --points ${2:-$E/page_score_points.json} --shapes 16x32768 --json-out $OUT/speed.json 2>&1 | grep -v Warn | tail -n 14
    ;;
acc)
    ctx=${2:-2048}; shift; shift
    [ -f /root/.cache/sparsetune/calibration/smollm2-135m.json ] || $ST flows calibrate --model smollm2-135m > /dev/null || exit 1
    specs=${@:-block_topk_2l $E/sub4_2l.py double_sparse_2l,channels=16 double_sparse_2l,channels=8 double_sparse_2l,channels=32 $E/sub4cp_2l.py,channels=16 double_sparse_2l,channels=16,coarse=3}
    for spec in $specs; do
        IFS=, read -r flow rest <<< "$spec"
        ps=(); [[ "$rest" == *budget_ratio=* ]] || ps=(--param budget_ratio=0.125); for kv in ${rest//,/ }; do ps+=(--param "$kv"); done
        t0=$(date +%s)
        $ST eval --context "$ctx" --samples 10 --seed 123 --mode accuracy --defaults published "${ps[@]}" --flow "$flow" \
            --out /tmp/ev --json > "$OUT/acc_${ctx}_$(basename "${flow%.py}")_${rest//[=,]/_}.json" 2> /tmp/ev.log || tail -n 3 /tmp/ev.log
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], $ctx, d['relative_accuracy'], d['accuracy'], d['dense_accuracy'], '$(( $(date +%s) - t0 )) s')" \
            "$OUT/acc_${ctx}_$(basename "${flow%.py}")_${rest//[=,]/_}.json" "$spec"
    done
    ;;
*) sed -n 2,6p "$0"; exit 2 ;;
esac
