#!/bin/bash
# Real vLLM on one lent GPU, driven by agentload's own CLI (issue 19's proving ground).
# Device side; the bundle comes from `agentload gpu bundle -o .gpu` and travels in two
# loads, so the steps are separate calls on one warm machine:
#
#   STEP=unpack   (carry .gpu/vllm.tar.xz .gpu/stage.sh)   unpack vLLM
#   STEP=compare  (carry .gpu/site.tar.xz .gpu/stage.sh)   moe-graphs vs moe-ngram, profiled
#   STEP=eager    (nothing more to carry)                  moe-eager replay, profiled; agree
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

if [ "$STEP" = eager ]; then
  log "serve moe-eager"
  al serve --arm arms/gpu-1x.toml:moe-eager --port 8011 --log "$RUNS/eager-server.log" \
     > "$RUNS/eager-serve.txt" 2>&1 &
  for i in $(seq 1 120); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" \
      2>/dev/null && break; sleep 2
  done
  log "replay moe-eager (profiled)"
  timeout "${LIMIT:-200}" python3 -P -m agentload replay tests/data/weka --target http://127.0.0.1:8011 "${TRACE_ARGS[@]:2}" \
     --duration "${DURATION:-45}" --profile-window 20:24 --headless -o "$RUNS/moe-eager" \
     2>&1 | tee "$OUT/eager.txt"
  log "bench agree against vllm bench serve"
  timeout 200 python3 -P -m agentload bench agree --target http://127.0.0.1:8011 --requests 128 --runs 3 \
     --json > "$RUNS/agree.json" 2> "$OUT/agree.txt"
  tail -5 "$RUNS/agree.json"
  log "profile moe-eager"; profile_tables moe-eager > "$OUT/profile-moe-eager.txt" 2>&1
  for g in "$PROFILES"/moe-graphs/*.json.gz; do
    for e in "$PROFILES"/moe-eager/*.json.gz; do
      [ -f "$g" ] && [ -f "$e" ] && al profile diff "$e" "$g" >> "$OUT/profile-diff.txt" 2>&1
    done
  done
  pkill -f "port 8011" || true
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
tar -cf "$OUT/profiles-$STEP.tar" -C "$ship" . 2>/dev/null
ls -la "$OUT" "$ship"
