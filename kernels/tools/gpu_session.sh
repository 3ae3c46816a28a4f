#!/usr/bin/env bash
# One device call: set up AOT kernels + tvm-ffi, record the card, then run what $1 names.
# Usage (repo root, on the GPU machine): bash kernels/tools/gpu_session.sh "ceil test attn layers probe bench" [bench args]
# (attn: bench --attention-only $BENCH_ARGS; layers: bench --layers-only --no-compile $LAYER_ARGS
#  + traces + profile diff; e.g. BENCH_ARGS="--batches 1 --contexts 32768";
#  probe: kernels/tools/attn_probe.py $PROBE_ARGS, batch-1 attention over four KV layouts,
#  or with PROBE_ARGS=--timeline each CTA's phases)
# Needs .devcarry/ (carried): apache_tvm_ffi wheel, libcute_dsl_runtime.so.xz, kc/*.so or
# kc.tar.xz (tar -cJf .devcarry/kc.tar.xz -C KERNEL_CACHE/sm_90a .).
set -u
export PYTHONUNBUFFERED=1
R=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$R"/.devcarry/apache_tvm_ffi-*.whl || exit 3
mkdir -p /tmp/kc/sm_90a /tmp/pkg/agentload
if [ -f "$R"/.devcarry/kc.tar.xz ]; then  # the kernels packed (they compress ~5x)
  python3 -c "import tarfile; tarfile.open('$R/.devcarry/kc.tar.xz').extractall('/tmp/kc/sm_90a')" || exit 4
else cp "$R"/.devcarry/kc/*.so /tmp/kc/sm_90a/; fi
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$R/.devcarry/libcute_dsl_runtime.so.xz'), open('/tmp/kc/sm_90a/libcute_dsl_runtime.so','wb'))" || exit 4
for f in "$R"/agentload/*.py; do ln -sf "$f" /tmp/pkg/agentload/; done
for r in traces replay profiler kernels tui; do ln -sfn "$R/$r" /tmp/pkg/agentload/$r; done
export PYTHONPATH=/tmp/pkg:/tmp/site AGENTLOAD_KERNEL_CACHE=/tmp/kc AGENTLOAD_CEILINGS=$OUT/ceilings.json
cd /tmp
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,memory.used --format=csv > "$OUT/card.txt" 2>&1
python3 -c "import torch, tvm_ffi; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tvm_ffi', tvm_ffi.__version__, 'exchange_api', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))" >> "$OUT/card.txt" 2>&1
cat "$OUT/card.txt"
steps=${1:-"ceil test bench"}; shift || true
case " $steps " in *" ceil "*)
  python3 -m agentload.kernels.bench ceilings --out "$OUT/ceilings.json" 2>&1 | tail -3 ;; esac
case " $steps " in *" test "*)
  timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir="$R" \
    -c "$R/pyproject.toml" -o addopts="" ${TESTS:-"$R/tests/integration/test_kernels_gpu.py" "$R/tests/integration/test_attention_gpu.py" "$R/tests/kernels/test_kernels.py"} \
    > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"; grep -E "passed|failed|Error" "$OUT/pytest.log" | tail -25 ;; esac
case " $steps " in *" attn "*)
  timeout "${ATTN_LIMIT:-300}" python3 -m agentload.kernels.bench kernels --ceilings "$OUT/ceilings.json" \
    --out "$OUT/attn.json" --attention-only ${BENCH_ARGS:-} 2>&1 | tee "$OUT/attn.log" | grep -v "^  skip" ;; esac
case " $steps " in *" layers "*)
  timeout "${LAYERS_LIMIT:-400}" python3 -m agentload.kernels.bench kernels --ceilings "$OUT/ceilings.json" \
    --out "$OUT/layers.json" --layers-only --no-compile --trace-dir "$OUT/traces" ${LAYER_ARGS:-} 2>&1 \
    | tee "$OUT/layers.log" | grep -v "^  skip"
  # profile diff needs typer and polars: from the staged bundle when one is there, else
  # run it where the traces come back (agentload profile diff STANDARD FUSED)
  for b in 1 8 64; do
    if [ -f /tmp/agentload-gpu/env.sh ]; then (cd "$R"; . /tmp/agentload-gpu/env.sh
      python3 -P -m agentload profile diff "$OUT/traces/kernels-trace-b$b-standard.json" \
      "$OUT/traces/kernels-trace-b$b-fused.json") 2>&1 | tee -a "$OUT/layers.log" | head -30
    else echo "profile diff b$b: no staged bundle here (polars); run it on traces.tar.gz"; fi
  done
  tar -czf "$OUT/traces.tar.gz" -C "$OUT" traces && rm -rf "$OUT/traces" ;; esac
case " $steps " in *" probe "*)
  timeout "${PROBE_LIMIT:-120}" python3 -m agentload.kernels.tools.attn_probe ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/probe.log" ;; esac
case " $steps " in *" bench "*)
  python3 -m agentload.kernels.bench kernels --ceilings "$OUT/ceilings.json" --out "$OUT/bench.json" \
    --trace-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^  skip" ;; esac
# A device call brings back at most 8 files: past that, the logs travel as one archive
# (the JSONs and traces.tar.gz stay apart; the logs' tails are in the call's output).
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar -czf logs.tar.gz -- *.log *.txt && rm -f -- *.log *.txt)
fi
exit 0
