#!/bin/bash
# agentload's client at fleet scale on the lent 16-core machine (issue 21's benchmark):
# the emulator on its own cores, agentload's workers (and vllm bench serve) on the rest.
# Device side, after `STEP=unpack bash tests/gpu/proving_ground.sh` on the same warm
# machine (vllm bench serve comes from that bundle); everything comes back under $OUT.
#
#   EMU_CPUS=0-5 CLIENT_CPUS=6-15 ITL_MS=10 bash tests/gpu/client_scaling.sh
#
# Carry .gpu/stage.sh (and .gpu/ray.tar.xz from `agentload gpu bundle --only-ray` for the
# Ray rows: two local Ray nodes on the client cores, each count again as Ray actors).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PREFIX=/tmp/agentload-gpu
# From the repository root, its front-door agentload/ folder would shadow the staged
# package in every child python: safe paths everywhere.
export PYTHONSAFEPATH=1
# Default split of the CPUs this process may use: the first 6 for the emulator, the rest
# for the clients (the cpuset need not start at 0).
read -r first_cpu last_cpu < <(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); print(c[0], c[-1])")
EMU_PROCS=${EMU_PROCS:-6}; EMU_CPUS=${EMU_CPUS:-$first_cpu-$((first_cpu + 5))}
CLIENT_CPUS=${CLIENT_CPUS:-$((first_cpu + 6))-$last_cpu}
ITL_MS=${ITL_MS:-10}
log() { echo "== $(date +%T) $*"; }
AGENTLOAD_SRC=$PWD bash .gpu/stage.sh .gpu "$PREFIX" > "$OUT/stage.txt" 2>&1
. "$PREFIX/env.sh"
# Out of the checkout: Ray puts the driver's working directory first on its workers'
# sys.path, where the checkout's front-door agentload/ would shadow the staged package.
cd /tmp
{ nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node0"; nvidia-smi -L; } > "$OUT/machine.txt" 2>&1
common=(--emulator-procs "$EMU_PROCS" --emulator-cpus "$EMU_CPUS" --cpus "$CLIENT_CPUS"
        --itl-ms "$ITL_MS")
# With the bundle's Ray load staged (gpu bundle --with-ray): two local Ray nodes on the
# client cores, and each worker count runs again as Ray actors (RAY=0: skip).
ray_args=()
ray_cli() { python3 -c "from ray.scripts.scripts import main; main()" "$@"; }
if [ "${RAY:-1}" = 1 ] && python3 -c "import ray" 2>/dev/null; then
  small=(--num-cpus "${RAY_NODE_CPUS:-8}" --object-store-memory $((200 << 20)))
  log "two local Ray nodes on CPUs $CLIENT_CPUS"
  taskset -c "$CLIENT_CPUS" python3 -c "from ray.scripts.scripts import main; main()" start \
     --head --node-ip-address 127.0.0.1 --port 26379 "${small[@]}" --include-dashboard false \
     --disable-usage-stats > "$OUT/ray.txt" 2>&1 &&
  taskset -c "$CLIENT_CPUS" python3 -c "from ray.scripts.scripts import main; main()" start \
     --address 127.0.0.1:26379 --node-ip-address 127.0.0.1 "${small[@]}" >> "$OUT/ray.txt" 2>&1 &&
  ray_args=(--ray 127.0.0.1:26379) || log "Ray did not start: $(tail -3 "$OUT/ray.txt")"
fi
log "scaling at ${STREAMS:-2000} streams over workers ${COUNTS:-1,2,4,8}"
timeout "${SCALING_LIMIT:-300}" python3 -P -m agentload bench client --streams "${STREAMS:-2000}" \
   --workers "${COUNTS:-1,2,4,8}" --no-vllm-bench "${common[@]}" "${ray_args[@]}" --json \
   > "$OUT/scaling.json" 2> "$OUT/scaling.txt"
python3 -P -c "import json,sys; from agentload.replay.bench.client_bench import scaling_lines; print(chr(10).join(scaling_lines(json.load(open(sys.argv[1])))))" \
   "$OUT/scaling.json" 2>&1 | tee -a "$OUT/scaling.txt"
if [ "${VS_VLLM:-1}" = 1 ]; then
  log "agentload (${VS_WORKERS:-8} workers) vs vllm bench serve at 1000 streams"
  timeout "${VS_LIMIT:-240}" python3 -P -m agentload bench client --streams 1000 \
     --workers "${VS_WORKERS:-8}" "${common[@]}" --itl-ms "${VS_ITL_MS:-$ITL_MS}" --json > "$OUT/vs-vllm.json" 2> "$OUT/vs-vllm.txt"
  python3 -P -c "import json,sys; from agentload.replay.bench.client_bench import report_lines; print(chr(10).join(report_lines(json.load(open(sys.argv[1])))))" \
     "$OUT/vs-vllm.json" 2>&1 | tee -a "$OUT/vs-vllm.txt"
fi
[ ${#ray_args[@]} -gt 0 ] && ray_cli stop --force >> "$OUT/ray.txt" 2>&1
log done
