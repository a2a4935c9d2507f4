#!/usr/bin/env bash
# Accuracy evals on a lent GPU, one after another, each beside dense on the same prompts (float32,
# SAMPLES=10 a task = 80 prompts, SEED=123: no search draws it). After agent_hour.sh place/wheels/model:
#   bash benchmarks/acc_evals.sh "NAME:CONTEXT:FLOW[:k=v k=v ...]" ...
# (params space-separated: a value may hold commas, e.g. dense_layers=0,1,2). Writes $OUT/NAME.json
# (the eval's --json), prints one line each (with the eval's note: e.g. a budget that covers the context,
# so the figure is dense's); exits 1 if any eval failed (the rest still run).
# two_level_search.sh's held-out evals run through it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1
failed=0
for spec in "$@"; do
    IFS=: read -r name ctx flow kvs <<< "$spec"
    args=(); read -ra ps <<< "${kvs:-}"; for kv in "${ps[@]}"; do args+=(--param "$kv"); done
    if ! python3 -m sparsetune.cli.main eval --flow "$flow" "${args[@]}" --context "$ctx" --samples "${SAMPLES:-10}" \
        --seed "${SEED:-123}" --mode accuracy --dtype float32 --out /tmp/ev --json > "$OUT/$name.json" 2> "/tmp/$name.log"; then
        tail -n 3 "/tmp/$name.log"; failed=1; continue
    fi
    python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[2], d['context'], 'tokens: relative', d['relative_accuracy'], 'accuracy', d['accuracy'], 'dense', d['dense_accuracy'], d['seconds'], 's',
      *(['| NOTE:', d['note']] if d.get('note') else []))" "$OUT/$name.json" "$name"
done
exit $failed
