#!/usr/bin/env bash
# Accuracy evals on a lent GPU, one after another, each beside dense on the same prompts (float32,
# 10 samples a task = 80 prompts, seed 123: no search draws it). After agent_hour.sh place/wheels/model:
#   bash benchmarks/experiments/acc_evals.sh NAME:CONTEXT:FLOW:k=v,k=v ...
# Writes $OUT/NAME.json (the eval's --json) and prints one line each.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1
for spec in "$@"; do
    IFS=: read -r name ctx flow kvs <<< "$spec"
    args=(); IFS=, read -ra ps <<< "$kvs"; for kv in "${ps[@]}"; do args+=(--param "$kv"); done
    python3 -m sparsetune.cli.main eval --flow "$flow" "${args[@]}" --context "$ctx" --samples "${SAMPLES:-10}" \
        --seed "${SEED:-123}" --mode accuracy --dtype float32 --out /tmp/ev --json > "$OUT/$name.json" 2> "/tmp/$name.log" \
        || { tail -n 3 "/tmp/$name.log"; continue; }
    python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[2], d['context'], 'relative', d['relative_accuracy'], 'accuracy', d['accuracy'], 'dense', d['dense_accuracy'], d['seconds'], 's')" "$OUT/$name.json" "$name"
done
