#!/usr/bin/env bash
# The vLLM environment: vllm==0.34.0 installed without its dependencies (the full set pins
# GPU-only packages this registry cannot resolve), plus what its multimodal cache, config
# and v1.serial_utils modules import, torch 2.14.0 included (~6 GB, installed with uv,
# scripts/uv.sh: under a minute the first time here; nothing the second). shmstore is
# built into the same venv, so its entry point (`vllm.general_plugins` -> shmstore.vllm)
# is registered.
#
#   scripts/vllm.sh          install (idempotent)
#   scripts/vllm.sh test     ... then the whole Python suite (torch tests included) and
#                            the vLLM plugin tests
#   scripts/vllm.sh bench    ... then the vLLM cache benchmark (docs/vllm.md)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$PWD/python/.venv-vllm
py=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=(scripts/uv.sh pip install -q --python "$venv/bin/python")
# The modules the tests import: the caches, the codec, and the scheduler (whose handling of
# items covered by the prefix cache and of re-encoding the tests run). cbor2, llguidance
# and xgrammar (at vLLM's pins) are what the scheduler module needs beyond the rest.
if ! "$venv/bin/python" -c "import vllm.multimodal.cache, vllm.v1.serial_utils, vllm.v1.core.sched.scheduler" 2>/dev/null; then
  "${pip[@]}" "torch==2.14.0" "numpy>=1.24" msgspec cachetools "pydantic>=2.12" regex \
    psutil blake3 "transformers>=5.16.1,<5.23" pyzmq cloudpickle pillow huggingface_hub \
    tokenizers safetensors pyyaml tqdm requests einops aiohttp pybase64 uvloop py-cpuinfo \
    openai fastapi prometheus_client "maturin>=1.7,<2" "pytest>=7" ml_dtypes cbor2 \
    "llguidance>=1.7,<1.8" "xgrammar==0.2.8"
  "${pip[@]}" --no-deps "vllm==0.34.0"
fi
"${pip[@]}" "maturin>=1.7,<2" "pytest>=7"
scripts/cli-into-package.sh
(cd python && VIRTUAL_ENV=$venv "$venv/bin/maturin" develop --release -q)
case "${1:-}" in
  "") echo "installed: $venv/bin/python -c 'import vllm, shmstore.vllm'" ;;
  # Two runs: each suite has a conftest module of its own.
  test) shift; "$venv/bin/python" -m pytest -q python/tests "$@"
        "$venv/bin/python" -m pytest -q python/tests_vllm "$@" ;;
  bench) shift; "$venv/bin/python" python/benchmarks/vllm_cache.py "$@" ;;
  *) echo "usage: scripts/vllm.sh [test|bench]" >&2; exit 2 ;;
esac
