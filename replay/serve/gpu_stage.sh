#!/bin/bash
# Device side of `agentload gpu bundle`: unpack the loads present, check the imports, write
# env.sh. Run it on the GPU box (no network needed), once per load as they arrive:
#
#   bash BUNDLE/stage.sh [BUNDLE] [PREFIX]      # BUNDLE: this script's folder by default
#   . PREFIX/env.sh                             # PREFIX: /tmp/agentload-gpu by default
#   python3 -m agentload compare --arms arms/gpu-1x.toml --only moe-graphs,moe-ngram ...
#
# A load already unpacked (same sha256) is skipped, so running it again is cheap.
set -euo pipefail
BUNDLE=${1:-$(cd "$(dirname "$0")" && pwd)}
PREFIX=${2:-/tmp/agentload-gpu}
mkdir -p "$PREFIX"
t0=$(date +%s.%N)
since() { python3 -c "import time; print(f'{time.time() - $t0:.1f} s')"; }
for load in vllm site ray; do
  archive="$BUNDLE/$load.tar.xz"
  if [ ! -f "$archive" ]; then  # ray.tar.xz is optional (gpu bundle --with-ray)
    [ "$load" = ray ] || echo "stage: $load.tar.xz not here (not carried in this call?)"
    continue
  fi
  sum=$(sha256sum "$archive" | cut -c1-16)
  if [ "$(cat "$PREFIX/.$load.sha" 2>/dev/null)" = "$sum" ]; then
    echo "stage: $load already unpacked"; continue
  fi
  dest="$PREFIX"; [ "$load" = vllm ] && dest="$PREFIX/site"
  mkdir -p "$dest"
  xz -dc -T0 "$archive" | tar -xf - -C "$dest"
  echo "$sum" > "$PREFIX/.$load.sha"
  echo "stage: unpacked $load.tar.xz ($(du -sh "$archive" | cut -f1)) after $(since)"
done
# AGENTLOAD_SRC=CHECKOUT: run agentload from that checkout (mapped as pyproject.toml's
# package-dir maps it) ahead of the bundled wheel, so code edited since the bundle counts.
path="$PREFIX/site"
if [ -n "${AGENTLOAD_SRC:-}" ]; then
  "${PYTHON:-python3}" - "$AGENTLOAD_SRC" "$PREFIX/src" <<'EOF'
import shutil, sys, tomllib
from pathlib import Path
src, dst = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
dirs = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
shutil.rmtree(dst, ignore_errors=True)
for package, folder in dirs.items():
    target = dst.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    for item in (src / folder).iterdir():
        if item.is_file():
            (target / item.name).symlink_to(item)
print(f"stage: agentload from {src}")
EOF
  path="$PREFIX/src:$path"
fi
# Ray's load goes after the site: where both hold a package, the site's pin wins.
[ -f "$PREFIX/.ray.sha" ] && path="$path:$PREFIX/ray-site"
cat > "$PREFIX/env.sh" <<EOF
export PYTHONPATH="$path\${PYTHONPATH:+:\$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0
export AGENTLOAD_CACHE="$PREFIX/cache"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# FlashInfer is not in the bundle: vLLM samples with its own top-k/top-p kernels.
export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_CACHE_ROOT="$PREFIX/vllm-cache" PYTHONUNBUFFERED=1
EOF
. "$PREFIX/env.sh"
if [ -f "$PREFIX/.vllm.sha" ] && [ -f "$PREFIX/.site.sha" ]; then
  "${PYTHON:-python3}" - <<'EOF'
import time
t = time.time()
import torch, vllm, agentload
print(f"stage: import vllm {vllm.__version__} + agentload {agentload.__version__} ok "
      f"({time.time() - t:.1f} s); torch {torch.__version__},",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF
fi
if [ -f "$PREFIX/.ray.sha" ]; then
  "${PYTHON:-python3}" -c "import ray; print('stage: import ray', ray.__version__, 'ok')"
fi
echo "stage: done after $(since); now: . $PREFIX/env.sh"
