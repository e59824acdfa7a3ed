#!/usr/bin/env bash
# End-to-end benchmark on ONE H200: Serve (config/serve-h200.yaml: full-shape LLM with random weights +
# full vocoder, fractional GPUs of one card) driven through HTTP by bench/client.py at concurrency
# 1, 8, 64, 128, 256 with a 512-token prompt and a fixed generation length; then the same workload in
# process (bench/pipeline.py, no Ray) to separate engine time from serving overhead.
# Everything stays on 127.0.0.1. Results (JSON, PNG, logs, the exact commands) go to $OUT.
#
#   bash bench/h200_e2e.sh               # GPU machine, from the repo root; stops within ~8 minutes
#   bash bench/h200_e2e.sh --cpu-smoke   # same steps on CPU with config/serve.yaml and tiny sizes
#
# On the GPU machine Ray comes from the wheels of ../shared/tools/device-ray-wheels.sh: if `import ray`
# fails and /tmp/rayparts holds the parts, this script assembles and installs them into /tmp/site.
# Knobs (environment): OUT, CONFIG, BUDGET_S (total seconds, default 470), MAX_NEW_TOKENS, PROMPT_TOKENS,
# LEVELS (none: no closed loop), REQUESTS, PIPE_LEVELS, PIPE_REQUESTS, PYTHON, PHASES (default
# serve,pipeline: which parts run; one per device call when each needs most of the call, e.g. with the
# vocoder warm-up of serve-h200.yaml), OPEN_RATES (comma separated arrivals per second: open-loop runs
# over Serve after the closed loop, each OPEN_DURATION seconds of arrivals, default 30), STEADY_LEVELS /
# STEADY_REQUESTS / RAMP_S (a second closed loop over Serve whose workers' first requests are spread over
# RAMP_S seconds: steady state instead of a burst; none by default), LISTEN_LEVELS / LISTEN_REQUESTS (a closed
# loop of listeners, ramped over RAMP_S: each worker plays a reply in real time before its next request,
# bench/client.py --listen; none by default), PIPE_RAMP_S (the same ramp for pipeline.py), PIPE_LISTEN (1:
# pipeline.py's levels are listeners too, --listen),
# SERVE_OPTIMIZED (1: bench/serve_app.py --throughput-optimized, Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED=1) with
# CLIENT_DIRECT (1: the client sends to the ingress replica's own HTTP server, the ready file's direct_url,
# instead of Serve's proxy), MPS (1: run an NVIDIA MPS control daemon for the run, pipe and logs under /tmp, so that the LLM and vocoder
# processes share the GPU concurrently instead of time-slicing it; stopped at the end; GPU mode only),
# SPEECH_LEVELS / SPEECH_REQUESTS / SPEECH_INPUT_S (a closed loop of spoken questions after the text one:
# bench/client.py --speech-input-s, streamed chats with a WAV of SPEECH_INPUT_S seconds, default 5; none by default),
# BUNDLE (a .tgz path outside $OUT: the whole of $OUT archived there at the end, for a device call, which
# brings back only a limited number of files: `BUNDLE=$OUT/run.tgz OUT=/tmp/run bash bench/h200_e2e.sh`,
# BUNDLE first, since a command's assignments expand in order).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = "--cpu-smoke" ] && MODE=cpu
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
OUT=${OUT:-/tmp/h200_e2e_out}
PHASES=${PHASES:-serve,pipeline}
OPEN_RATES=${OPEN_RATES:-}; OPEN_DURATION=${OPEN_DURATION:-30}
STEADY_LEVELS=${STEADY_LEVELS:-}; STEADY_REQUESTS=${STEADY_REQUESTS:-}; LISTEN_LEVELS=${LISTEN_LEVELS:-}
LISTEN_REQUESTS=${LISTEN_REQUESTS:-}; RAMP_S=${RAMP_S:-3}; PIPE_RAMP_S=${PIPE_RAMP_S:-0}
mkdir -p "$OUT"
case "${BUNDLE:-}" in "$OUT"/*) echo "BUNDLE ($BUNDLE) must lie outside OUT ($OUT)" >&2; exit 2;; esac
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
if [ "$MODE" = gpu ]; then
  PY=${PYTHON:-python3}
  CONFIG=${CONFIG:-config/serve-h200.yaml}
  PROMPT_TOKENS=${PROMPT_TOKENS:-512}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-100}
  LEVELS=${LEVELS:-1,8,64,128,256}; REQUESTS=${REQUESTS:-6,16,64,128,256}; WARMUP=2
  PIPE_LEVELS=${PIPE_LEVELS:-1,8,64,256}; PIPE_REQUESTS=${PIPE_REQUESTS:-4,16,64,256}
  PIPE_MODEL=(--preset full --random-weights --device cuda)
  SERVE_CAP=300; PIPE_CAP=170
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  PY=${PYTHON:-.venv/bin/python}
  CONFIG=${CONFIG:-config/serve.yaml}
  PROMPT_TOKENS=${PROMPT_TOKENS:-200}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-24}
  LEVELS=${LEVELS:-1,2}; REQUESTS=${REQUESTS:-2,2}; WARMUP=1
  PIPE_LEVELS=${PIPE_LEVELS:-1,2}; PIPE_REQUESTS=${PIPE_REQUESTS:-2,2}
  PIPE_MODEL=(--preset tiny --device cpu)
  SERVE_CAP=150; PIPE_CAP=150
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
cap() { local want=$1 rest; rest=$(( $(left) - 25 )); [ "$rest" -lt "$want" ] && want=$rest; [ "$want" -lt 1 ] && want=1; echo "$want"; }
record() { printf '%q ' "$@" >> "$OUT/commands.txt"; echo >> "$OUT/commands.txt"; }  # exact, shell-quoted
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

echo "# from the repo root, with: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled" \
  "RAY_USAGE_STATS_ENABLED=0 PYTHONPATH=$PYTHONPATH" > "$OUT/commands.txt"
log "mode=$MODE config=$CONFIG out=$OUT budget=${BUDGET_S}s"

# Ray on the GPU machine: assemble the carried wheel parts once (see device-ray-wheels.sh).
if ! "$PY" -c 'import ray' 2>/dev/null && ls /tmp/rayparts/ray.part.* >/dev/null 2>&1; then
  log "installing Ray from /tmp/rayparts into /tmp/site"
  cat /tmp/rayparts/ray.part.* > /tmp/rayparts/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  rm -f /tmp/rayparts/ray.part.*
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/rayparts/*.whl \
    >> "$OUT/log.txt" 2>&1 || log "pip install failed"
fi
NEEDED='yaml, numpy, torch'; [[ ,$PHASES, == *,serve,* ]] && NEEDED="ray, ray.serve, httpx, $NEEDED"
if ! "$PY" -c "import $NEEDED" 2>> "$OUT/log.txt"; then
  log "FATAL: missing packages (see log.txt). bench/client.py needs httpx: carry its wheels with"
  log "  bash ../shared/tools/device-ray-wheels.sh httpx==0.28.1 httpcore==1.0.9 h11==0.16.0"
  exit 2
fi
PLOT=1
"$PY" -c 'import matplotlib' 2>/dev/null || { PLOT=0; log "no matplotlib here: PNGs skipped (replot: python bench/measure.py X.json X.png)"; }
{
  echo "date: $(date -u +%FT%TZ)"; echo "python: $("$PY" -V 2>&1)"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  "$PY" -c 'import ray; print("ray", ray.__version__)' 2>/dev/null
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)"; nproc
} > "$OUT/env.txt" 2>&1
cp "$CONFIG" "$OUT/serve-config.yaml"

MPS_UP=0
if [ "${MPS:-0}" = 1 ] && [ "$MODE" = gpu ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >> "$OUT/log.txt" 2>&1 \
      && "$PY" -c 'import torch; torch.ones(1, device="cuda").sum().item()' >> "$OUT/log.txt" 2>&1; then
    MPS_UP=1; log "MPS control daemon up (pipe $CUDA_MPS_PIPE_DIRECTORY)"; echo "mps: on" >> "$OUT/env.txt"
  else
    log "FATAL: MPS requested but a CUDA process could not start under it (see log.txt)"
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; exit 4
  fi
fi
GPU_LOG_PID=""
if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv -l 2 \
    > "$OUT/gpu_samples.csv" 2>&1 &
  GPU_LOG_PID=$!
fi
SERVE_PID=""
stop_serve() {
  [ -z "$SERVE_PID" ] && return
  kill -TERM "$SERVE_PID" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$SERVE_PID" 2>/dev/null && { log "serve_app did not stop in 30 s: SIGKILL"; kill -KILL "$SERVE_PID"; }
  wait "$SERVE_PID" 2>/dev/null
  SERVE_PID=""
}
cleanup() {
  stop_serve; [ -n "$GPU_LOG_PID" ] && kill "$GPU_LOG_PID" 2>/dev/null
  if [ "$MPS_UP" = 1 ]; then
    echo quit | nvidia-cuda-mps-control; cp /tmp/mps-log/*.log "$OUT/" 2>/dev/null; log "MPS daemon stopped"
  fi
  log "done"
}
trap cleanup EXIT

# ---- 1. Serve on 127.0.0.1, then the HTTP client at every concurrency level ----
serve_phase() {
  HTTP_PORT=$(free_port); METRICS_PORT=$(free_port)
  SERVE_CMD=("$PY" bench/serve_app.py --config "$CONFIG" --port "$HTTP_PORT" --metrics-port "$METRICS_PORT"
             --ready-file "$OUT/serve_ready.json")
  [ "$MODE" = cpu ] && SERVE_CMD+=(--num-cpus 2)
  [ "${SERVE_OPTIMIZED:-0}" = 1 ] && SERVE_CMD+=(--throughput-optimized)
  record "${SERVE_CMD[@]}"
  log "starting Serve: ${SERVE_CMD[*]}"
  rm -f "$OUT/serve_ready.json"  # a ready file of an earlier run in the same OUT must not count
  "${SERVE_CMD[@]}" > "$OUT/serve_app.log" 2>&1 &
  SERVE_PID=$!
  READY_BY=$(( $(date +%s) + $(cap $SERVE_CAP) ))
  until [ -s "$OUT/serve_ready.json" ]; do
    if ! kill -0 "$SERVE_PID" 2>/dev/null || [ "$(date +%s)" -ge "$READY_BY" ]; then
      log "Serve did not become ready; tail of serve_app.log:"; tail -n 40 "$OUT/serve_app.log"
      stop_serve
      return 3
    fi
    sleep 1
  done
  URL="http://127.0.0.1:$HTTP_PORT"
  if [ "${CLIENT_DIRECT:-0}" = 1 ]; then
    URL=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["direct_url"] or "")' "$OUT/serve_ready.json")
    [ -n "$URL" ] || { log "CLIENT_DIRECT=1 needs SERVE_OPTIMIZED=1 (no direct_url)"; stop_serve; return 3; }
  fi
  log "Serve ready: $(cat "$OUT/serve_ready.json")"
  for pid in $(pgrep -f 'ServeReplica' || true); do  # the MPS settings each replica process started with
    echo "replica $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-48): $(tr '\0' '\n' < "/proc/$pid/environ" \
      | grep '^CUDA_MPS_' | tr '\n' ' ')" >> "$OUT/env.txt" 2>/dev/null
  done
  "$PY" - "$URL" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import sys, httpx
print("health:", httpx.get(sys.argv[1] + "/health", timeout=10).text)
EOF

  snapshot() {  # the moss_* lines of a metrics scrape now: stage split per client phase in the digest
    "$PY" - "$METRICS_PORT" "$OUT/metrics_$1.prom" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import sys, httpx
text = httpx.get(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=30).text
open(sys.argv[2], "w").write("\n".join(l for l in text.splitlines() if "moss_" in l) + "\n")
EOF
  }
  snapshot start
  COMMON=(--warmup "$WARMUP" --prompt-tokens "$PROMPT_TOKENS" --max-new-tokens "$MAX_NEW_TOKENS"
          --fixed-length --response-format pcm --server-summary --timeout 300)
  RESERVE=30; [[ ,$PHASES, == *,pipeline,* ]] && RESERVE=$(( PIPE_CAP + 30 ))
  if [ "$LEVELS" != none ]; then
    CLIENT_CMD=("$PY" bench/client.py --url "$URL" --concurrency "$LEVELS" --requests "$REQUESTS" "${COMMON[@]}"
                --label "$MODE serve $CONFIG" --out "$OUT/client_closed.json")
    [ "$PLOT" = 1 ] && CLIENT_CMD+=(--plot "$OUT/client_closed.png")
    record "${CLIENT_CMD[@]}"
    T_CLIENT=$(cap $(( $(left) - RESERVE )))  # leave Serve's shutdown (and the in-process run) their share
    log "client (timeout ${T_CLIENT}s): ${CLIENT_CMD[*]}"
    timeout --kill-after=10 "$T_CLIENT" "${CLIENT_CMD[@]}" > "$OUT/client_stdout.txt" 2> "$OUT/client_stderr.txt"
    log "client exit $? ($(wc -c < "$OUT/client_stdout.txt") bytes of JSON)"
    snapshot closed
  fi
  ramped_client() {  # NAME LEVELS REQUESTS WHAT [client args]: a closed loop, first requests spread over RAMP_S
    local name=$1 levels=$2 requests=$3 what=$4; shift 4
    local cmd=("$PY" bench/client.py --url "$URL" --concurrency "$levels" --ramp-s "$RAMP_S" "$@" "${COMMON[@]}"
               --label "$MODE serve $CONFIG $what (ramp ${RAMP_S}s)" --out "$OUT/client_$name.json")
    [ -n "$requests" ] && cmd+=(--requests "$requests")
    [ "$PLOT" = 1 ] && cmd+=(--plot "$OUT/client_$name.png")
    record "${cmd[@]}"
    T_CLIENT=$(cap $(( $(left) - RESERVE )))
    log "$what client (timeout ${T_CLIENT}s): ${cmd[*]}"
    timeout --kill-after=10 "$T_CLIENT" "${cmd[@]}" > "$OUT/client_$name.stdout" 2>> "$OUT/client_stderr.txt"
    log "$what client exit $?"
    snapshot "$name"
  }
  if [ -n "${SPEECH_LEVELS:-}" ]; then  # spoken questions: the chat route, the speech encoder before the LLM
    SPEECH_CMD=("$PY" bench/client.py --url "$URL" --concurrency "$SPEECH_LEVELS" --warmup "$WARMUP"
                --speech-input-s "${SPEECH_INPUT_S:-5}" --max-new-tokens "$MAX_NEW_TOKENS" --fixed-length
                --server-summary --timeout 300 --label "$MODE serve $CONFIG spoken questions"
                --out "$OUT/client_speech.json")
    [ -n "${SPEECH_REQUESTS:-}" ] && SPEECH_CMD+=(--requests "$SPEECH_REQUESTS")
    record "${SPEECH_CMD[@]}"
    T_CLIENT=$(cap $(( $(left) - RESERVE )))
    log "spoken-question client (timeout ${T_CLIENT}s): ${SPEECH_CMD[*]}"
    timeout --kill-after=10 "$T_CLIENT" "${SPEECH_CMD[@]}" > "$OUT/client_speech.stdout" 2>> "$OUT/client_stderr.txt"
    log "spoken-question client exit $?"
    snapshot speech
  fi
  # the closed loop again in steady state; then listeners, each hearing a reply in real time before the next
  [ -n "$STEADY_LEVELS" ] && ramped_client steady "$STEADY_LEVELS" "$STEADY_REQUESTS" steady
  [ -n "$LISTEN_LEVELS" ] && ramped_client listen "$LISTEN_LEVELS" "$LISTEN_REQUESTS" listeners --listen
  for RATE in ${OPEN_RATES//,/ }; do  # open loop: Poisson arrivals at RATE per second for OPEN_DURATION s
    OPEN_CMD=("$PY" bench/client.py --url "$URL" --rate "$RATE" --duration "$OPEN_DURATION" "${COMMON[@]}"
              --label "$MODE serve $CONFIG open $RATE/s" --out "$OUT/client_open_$RATE.json")
    record "${OPEN_CMD[@]}"
    T_CLIENT=$(cap $(( $(left) - RESERVE )))
    log "open-loop client (timeout ${T_CLIENT}s): ${OPEN_CMD[*]}"
    timeout --kill-after=10 "$T_CLIENT" "${OPEN_CMD[@]}" > "$OUT/client_open_$RATE.stdout" 2>> "$OUT/client_stderr.txt"
    log "open-loop client exit $?"
    snapshot "open_$RATE"
  done

  "$PY" - "$URL" "$METRICS_PORT" "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import sys, httpx
url, port, out = sys.argv[1], sys.argv[2], sys.argv[3]
open(f"{out}/admin_stats.json", "w").write(httpx.get(url + "/admin/stats", timeout=30).text)
text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
open(f"{out}/server_metrics.prom", "w").write("\n".join(l for l in text.splitlines() if "moss_" in l) + "\n")
print("saved admin_stats.json and the moss_* lines of the metrics scrape")
EOF
  SESSION_DIR=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("session_dir") or "")' \
    "$OUT/serve_ready.json")
  log "stopping Serve"
  stop_serve
  if [ -n "$SESSION_DIR" ] && [ -d "$SESSION_DIR/logs/serve" ]; then   # this run's Ray only
    mkdir -p "$OUT/serve_logs"
    for f in "$SESSION_DIR"/logs/serve/*.log; do tail -n 100 "$f" > "$OUT/serve_logs/$(basename "$f")"; done
  fi
}
if [[ ,$PHASES, == *,serve,* ]]; then
  serve_phase || log "Serve phase failed (exit $?): going on with the in-process run"
fi

# ---- 2. The same workload in process (no Ray, no HTTP), with the engine settings of the config ----
PIPE_LABEL="$MODE in-process $CONFIG"
[ "${PIPE_LISTEN:-0}" = 1 ] && PIPE_LABEL="$PIPE_LABEL listeners (ramp ${PIPE_RAMP_S}s)"
PIPE_CMD=("$PY" bench/pipeline.py --config "$CONFIG" "${PIPE_MODEL[@]}" --concurrency "$PIPE_LEVELS"
          --requests "$PIPE_REQUESTS" --warmup "$WARMUP" --ramp-s "$PIPE_RAMP_S" --prompt-tokens "$PROMPT_TOKENS"
          --max-new-tokens "$MAX_NEW_TOKENS" --fixed-length --label "$PIPE_LABEL" --out "$OUT/pipeline.json")
[ "${PIPE_LISTEN:-0}" = 1 ] && PIPE_CMD+=(--listen)
[ "$PLOT" = 1 ] && PIPE_CMD+=(--plot "$OUT/pipeline.png")
T_PIPE=$(cap $PIPE_CAP)
[[ ,$PHASES, == *,serve,* ]] || T_PIPE=$(cap $(left))
if [[ ,$PHASES, != *,pipeline,* ]]; then
  log "pipeline.py not run (PHASES=$PHASES)"
elif [ "$T_PIPE" -lt 40 ]; then
  log "skipping pipeline.py: only ${T_PIPE}s left"
else
  record "${PIPE_CMD[@]}"
  log "pipeline (timeout ${T_PIPE}s): ${PIPE_CMD[*]}"
  timeout --kill-after=10 "$T_PIPE" "${PIPE_CMD[@]}" > "$OUT/pipeline_stdout.txt" 2> "$OUT/pipeline_stderr.txt"
  log "pipeline exit $?"
fi

if [ "$PLOT" = 1 ] && [ -s "$OUT/client_closed.json" ] && [ -s "$OUT/pipeline.json" ]; then
  record "$PY" bench/measure.py "$OUT/client_closed.json" "$OUT/pipeline.json" "$OUT/http_vs_inprocess.png"
  "$PY" bench/measure.py "$OUT/client_closed.json" "$OUT/pipeline.json" "$OUT/http_vs_inprocess.png" \
    >> "$OUT/log.txt" 2>&1 || log "comparison plot failed"
fi

# ---- 3. One-line digest per level (p50/p99 in ms) ----
"$PY" - "$OUT" <<'EOF' 2>&1 | tee "$OUT/digest.txt"
import json, os, sys
out = sys.argv[1]
for name in ["client_closed.json", "client_speech.json", "client_steady.json", "client_listen.json", "pipeline.json"] + sorted(f for f in os.listdir(out) if f.startswith("client_open_") and f.endswith(".json")):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{name}: missing"); continue
    s = json.load(open(path))
    print(f"{name}: complete={s['complete']} {s.get('device_name', '')}")
    for lv in s["levels"]:
        ms = lambda d, q: "-" if d[q] is None else f"{d[q] * 1000:.0f}"
        where = f"c={lv['concurrency']:>4}" if "concurrency" in lv else f"rate={lv['rate_per_s']}/s"
        print(f"  {where} ok={lv['num_ok']}/{lv['num_requests']} errors={lv['errors']} "
              f"ttfa p50/p99={ms(lv['ttfa_s'], 'p50')}/{ms(lv['ttfa_s'], 'p99')} "
              f"gap p50/p99={ms(lv['chunk_gap_s'], 'p50')}/{ms(lv['chunk_gap_s'], 'p99')} "
              f"rtf p50={lv['rtf']['p50'] and round(lv['rtf']['p50'], 3)} "
              f"audio_s/wall_s={lv['audio_s_per_wall_s'] and round(lv['audio_s_per_wall_s'], 2)} "
              f"underruns={lv['underruns']['total']} in {lv['underruns']['requests_with_underrun']} requests, "
              f"stall {lv['underruns']['stall_s_total']:.1f}s at audio s {lv['underruns'].get('by_audio_played_s', '-')} "
              f"codes={lv['num_audio_codes_seen']} "
              f"prompt={lv['num_prompt_tokens_seen']} driver_lag_p99={ms(lv.get('driver_loop_lag_s', {'p99': None}), 'p99')}")
        stages = lv.get("first_audio_stages_s") or {}
        if stages:  # the server's timeline (deployments/timeline.py): exact per request, p50 per stage
            n = next(iter(stages.values()))["count"]
            print(f"    first audio by stage, p50 ms over {n} requests: "
                  + " ".join(f"{k}={v['p50'] * 1000:.1f}" for k, v in stages.items()))
EOF
# Server-side stage split per client phase (difference of consecutive scrapes; includes warm-ups).
"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/digest.txt"
import os, sys
from deployments.monitor import delta, parse_samples, summarize, histogram_buckets, histogram_quantile
out = sys.argv[1]
names = [n for n in ("start", "closed", "speech", "steady", "listen") if os.path.exists(f"{out}/metrics_{n}.prom")]
names += sorted(f[8:-5] for f in os.listdir(out) if f.startswith("metrics_open_") and f.endswith(".prom"))
ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"
for before, after in zip(names, names[1:]):
    samples = delta(parse_samples(open(f"{out}/metrics_{after}.prom").read()),
                    parse_samples(open(f"{out}/metrics_{before}.prom").read()))
    s = summarize(samples)
    line = " ".join(f"{label} p50/p99={ms(s[key]['p50'])}/{ms(s[key]['p99'])}" for key, label in (
        ("time_to_first_code_s", "first_code"), ("time_to_first_pcm_s", "first_pcm"), ("time_to_first_audio_s", "ttfa")))
    steps = []
    for kind in ("first", "urgent", "background", "fifo", "finish", "fast-first", "fast-urgent", "encode"):
        b = histogram_buckets([x for x in samples if x.labels.get("kind") == kind], "ray_moss_vocoder_step_seconds")
        if b and b[-1][1]:
            steps.append(f"{kind} n={int(b[-1][1])} p50/p99={ms(histogram_quantile(0.5, b))}/{ms(histogram_quantile(0.99, b))}")
    print(f"server stages, {after}: {line}; vocoder steps (ms): {'; '.join(steps) or '-'}")
EOF
log "total $(( $(date +%s) - T0 ))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ -n "${BUNDLE:-}" ]; then  # one archive of $OUT (the device tool brings back a limited number of files per call)
  tar -czf "$BUNDLE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && log "bundled $OUT into $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
fi
