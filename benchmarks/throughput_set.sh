#!/usr/bin/env bash
# Vortex's setting (issue #43) for several flows side by side in one lease: `bench_throughput.py` runs
# one after another in the background (a dense run of 16K steps takes minutes; a call lasts 10 at
# most), so they outlive the call that starts them while the machine stays held (calls back to
# back). Random weights: no model files to place.
#   bash benchmarks/throughput_set.sh start MODEL RUN...   RUN: dense | FLOW[:k=v,k=v], then any @OPTION=VALUE
#                                                           (bench_throughput.py's --OPTION VALUE: @profile=12288)
#   bash benchmarks/throughput_set.sh collect [SECONDS]     waits up to SECONDS (default 540) for the set,
#                                                           then archives every set's rows so far to $OUT/throughput.tgz
# e.g. CUDA_VISIBLE_DEVICES=1 bash benchmarks/throughput_set.sh start qwen3-1.7b dense block_topk:budget=2048 \
#        quest:budget=2048 quest:budget=2048@profile=12288
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DIR=/tmp/tp; LOG=$DIR/set.log
export PYTHONPATH="$PWD:/tmp/pp" PYTHONUNBUFFERED=1
running() { pgrep -f "[t]hroughput_set.sh run" > /dev/null; }

case "${1:-}" in
start)
    model=${2:?MODEL}; shift 2
    running && { echo "a throughput set is still running (one at a time: its log is $LOG); collect it first"; exit 1; }
    for spec in "$@"; do
        case "$spec" in *@*) for o in $(echo "${spec#*@}" | tr @ ' '); do
            [[ "$o" == *=* ]] || { echo "$spec: write @OPTION=VALUE (bench_throughput.py's --OPTION VALUE)"; exit 2; }; done ;; esac
    done
    mkdir -p "$DIR"
    setsid nohup bash "$0" run "$model" "$@" > "$LOG" 2>&1 < /dev/null &
    sleep 2; running && echo "throughput set started: $model $*" || { cat "$LOG"; exit 1; }
    ;;
run)  # (the background part)
    model=$2; shift 2
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    for spec in "$@"; do
        run=${spec%%@*}; extra=()
        if [ "$run" != "$spec" ]; then IFS=@ read -ra opts <<< "${spec#*@}"; for o in "${opts[@]}"; do extra+=("--${o%%=*}" "${o#*=}"); done; fi
        flow=${run%%:*}; params=(); [ "$flow" != "$run" ] && IFS=, read -ra kv <<< "${run#*:}" && for p in "${kv[@]}"; do params+=(--param "$p"); done
        name=$(echo "${model}_$spec" | tr ':,=@/' '_____')
        echo "== $spec ($(date +%T))"
        python3 benchmarks/bench_throughput.py --model "$model" --flow "$flow" "${params[@]}" "${extra[@]}" \
            --json-out "$DIR/$name.json" 2>&1 | grep -v "^\s*$" | tail -n 3
    done
    echo "== done ($(date +%T))"
    ;;
collect)
    [ -d "$DIR" ] || { echo "no throughput set has started on this machine: start one first"; exit 1; }
    for _ in $(seq 1 $(( ${2:-540} / 10 ))); do running || break; sleep 10; done
    cat "$LOG"; tar -czf "$OUT/throughput.tgz" -C "$DIR" . && cp "$LOG" "$OUT"/  # one archive: a call returns 8 files at most
    if running; then echo "still running: call collect again"; fi
    ;;
*) sed -n 2,10p "$0"; exit 2 ;;
esac
