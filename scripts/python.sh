#!/usr/bin/env bash
# The Python package: builds shmstore's bindings and installs them into python/.venv
# (created if missing, with maturin, numpy, pytest and prometheus_client from PyPI).
#
#   scripts/python.sh           build + install (release build)
#   scripts/python.sh test      ... then run the pytest suite (python/tests)
#   scripts/python.sh bench     ... then the Python-overhead benchmark
#   scripts/python.sh example   ... then examples/vllm_like.py (engine + 2 workers)
#
# Afterwards: python/.venv/bin/python -c "import shmstore"
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/python/.venv
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.7,<2" "numpy>=1.24" "pytest>=7" \
  "prometheus_client>=0.17"
(cd python && VIRTUAL_ENV=$venv "$venv/bin/maturin" develop --release -q)
case "${1:-}" in
  "") echo "installed: $venv/bin/python -c 'import shmstore'" ;;
  test) shift; "$venv/bin/python" -m pytest -q python/tests "$@" ;;
  bench) shift; "$venv/bin/python" python/benchmarks/overhead.py "$@" ;;
  example) shift; "$venv/bin/python" examples/vllm_like.py "$@" ;;
  *) echo "usage: scripts/python.sh [test|bench|example]" >&2; exit 2 ;;
esac
