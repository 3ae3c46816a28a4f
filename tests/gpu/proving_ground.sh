#!/bin/bash
# Real vLLM on one lent GPU, driven by agentload's own CLI (issue 19's proving ground).
# Device side; the bundle comes from `agentload gpu bundle -o .gpu` and travels in two
# loads, so the steps are separate calls on one warm machine:
#
#   STEP=unpack   (carry .gpu/vllm.tar.xz .gpu/stage.sh)   unpack vLLM
#   STEP=compare  (carry .gpu/site.tar.xz .gpu/stage.sh)   moe-graphs vs moe-ngram, profiled
#   STEP=served   ARMS="moe-eager moe-fullgraph" AGREE=1   each arm served in turn: a profiled
#                                                          replay (bench agree on the first),
#                                                          then profile diff of the two
#                                                          (REPLAY=0: bench agree alone)
#
# Everything comes back under $OUT as a few tarballs (the device returns at most 8 files).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=${STEP:-compare}
PREFIX=/tmp/agentload-gpu
RUNS=/tmp/agentload-runs
PROFILES=/tmp/agentload-profiles
TRACE_ARGS=(--trace tests/data/weka --scale-tokens 0.25 --max-context 30000 --pause-cap 5
            --recycle --users "${USERS:-16}" --seed 1)
mkdir -p "$RUNS" "$PROFILES"
log() { echo "== $(date +%T) $*"; }

log "stage ($STEP)"; AGENTLOAD_SRC=$PWD bash .gpu/stage.sh .gpu "$PREFIX" 2>&1 | tee -a "$OUT/stage.txt"
[ "$STEP" = unpack ] && exit 0
. "$PREFIX/env.sh"
nvidia-smi -L | tee "$OUT/gpu.txt"
al() { python3 -P -m agentload "$@"; }

profile_tables() {  # $1: arm; the layer and step tables of each rank's trace
  for t in "$PROFILES/$1"/*.json.gz; do
    [ -f "$t" ] || { echo "no trace for $1"; continue; }
    ls -la "$t"
    al profile layers "$t" --level layer
    al profile steps "$t" | head -40
  done
}

if [ "$STEP" = compare ]; then
  ARMS=${ARMS:-moe-graphs,moe-ngram}
  log "compare $ARMS"
  # SIGTERM makes agentload stop, finalize and report what completed; pack runs after.
  timeout "${LIMIT:-470}" python3 -P -m agentload compare --arms arms/gpu-1x.toml --only "$ARMS" "${TRACE_ARGS[@]}" \
     --duration "${DURATION:-60}" --profile-window 30:34 --headless -o "$RUNS/gpu-ab" \
     2>&1 | tee "$OUT/compare.txt"
  for arm in ${ARMS//,/ }; do
    log "profile $arm"; profile_tables "$arm" > "$OUT/profile-$arm.txt" 2>&1
  done
fi

if [ "$STEP" = single ]; then  # one arm, agentload starting its server
  log "replay $ARM"
  timeout "${LIMIT:-300}" python3 -P -m agentload replay tests/data/weka \
     --arm "arms/gpu-1x.toml:$ARM" "${TRACE_ARGS[@]:2}" --duration "${DURATION:-40}" \
     --profile-window 25:29 --headless -o "$RUNS/$ARM" 2>&1 | tee "$OUT/$ARM.txt"
  tar -czf "$OUT/runs-$STEP.tar.gz" --exclude='*.html' -C "$RUNS" "$ARM"
  log "profile $ARM"; profile_tables "$ARM" > "$OUT/profile-$ARM.txt" 2>&1
fi

serve_arm() {  # $1: arm, served by `agentload serve` on port 8011 until it answers /health
  log "serve $1"
  al serve --arm "arms/gpu-1x.toml:$1" --port 8011 --log "$RUNS/$1-server.log" \
     > "$RUNS/$1-serve.txt" 2>&1 &
  for i in $(seq 1 150); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" \
      2>/dev/null && { log "$1 healthy"; return 0; }; sleep 2
  done
  log "$1 not healthy"; tail -30 "$RUNS/$1-server.log" "$RUNS/$1-serve.txt"; return 1
}
stop_arm() { pkill -f "port 8011"; sleep 8; pkill -9 -f "vllm.entrypoints" 2>/dev/null; sleep 2; }

if [ "$STEP" = served ]; then  # each of ARMS served in turn: a profiled replay; AGREE=1: bench agree on the first
  first=1
  for ARM in ${ARMS:-${ARM:-moe-fullgraph}}; do
    if serve_arm "$ARM"; then
      [ "${REPLAY:-1}" = 1 ] && log "replay $ARM (profiled)" && timeout "${LIMIT:-150}" python3 -P -m agentload replay tests/data/weka --target http://127.0.0.1:8011 \
         "${TRACE_ARGS[@]:2}" --duration "${DURATION:-35}" --profile-window 20:23 --headless \
         -o "$RUNS/$ARM" 2>&1 | tee "$OUT/$ARM.txt"
      if [ "${AGREE:-0}" = 1 ] && [ "$first" = 1 ]; then
        # AGREE_SETS: extra bench agree options per set, sets separated by "|"
        # (e.g. "|--input-len 1024"); each set's text and JSON come back as agree-<i>.*
        IFS='|' read -r -a sets <<< "${AGREE_SETS:-}"; [ ${#sets[@]} = 0 ] && sets=("")
        for i in "${!sets[@]}"; do
          log "bench agree against vllm bench serve (set $i: ${sets[$i]:-defaults})"
          # shellcheck disable=SC2086  # a set is a list of options
          timeout "${AGREE_LIMIT:-240}" python3 -P -m agentload bench agree --target http://127.0.0.1:8011 \
             --requests "${AGREE_REQUESTS:-128}" --runs "${AGREE_RUNS:-3}" ${sets[$i]} --json \
             > "$OUT/agree-$i.json" 2> "$OUT/agree-$i.txt"
          python3 -P -c "import json,sys; from agentload.replay.bench.agree import agree_lines; print(chr(10).join(agree_lines(json.load(open(sys.argv[1])))))" \
             "$OUT/agree-$i.json" 2>&1 | tee -a "$OUT/agree-$i.txt"
        done
      fi
      stop_arm
    fi
    first=0
    [ "${REPLAY:-1}" = 1 ] && log "profile $ARM" && profile_tables "$ARM" > "$OUT/profile-$ARM.txt" 2>&1
  done
  set -- ${ARMS:-}
  if [ $# -ge 2 ]; then  # the first two arms' traces of the same traffic, side by side
    for a in "$PROFILES/$1"/*.json.gz; do for b in "$PROFILES/$2"/*.json.gz; do
      [ -f "$a" ] && [ -f "$b" ] && al profile diff "$a" "$b" >> "$OUT/profile-diff.txt" 2>&1
    done; done
  fi
fi

log "pack"
# Run directories without the HTML (rebuilt here with `agentload report`); each trace
# whole when it fits the 16 MB a returned file may have, else its first 150k events.
tar -czf "$OUT/runs-$STEP.tar.gz" --exclude='*.html' -C "$RUNS" . 2>/dev/null
ship=/tmp/ship-$STEP; mkdir -p "$ship"
for t in "$PROFILES"/*/*.json.gz; do
  [ -f "$t" ] && [ ! -f "$t.shipped" ] || continue
  arm=$(basename "$(dirname "$t")"); dst="$ship/$arm-$(basename "$t")"
  if [ "$(stat -c %s "$t")" -lt 15000000 ]; then cp "$t" "$dst"
  else python3 tests/gpu/trim_trace.py "$t" "$dst" --events 150000; fi
  touch "$t.shipped"
done
[ -n "$(ls -A "$ship")" ] && tar -cf "$OUT/profiles-$STEP.tar" -C "$ship" .
ls -la "$OUT" "$ship"
