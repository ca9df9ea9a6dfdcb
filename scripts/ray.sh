#!/usr/bin/env bash
# shmstore.ray (one store per node, items cross nodes through Ray): the vLLM environment
# (scripts/vllm.sh) plus Ray, the version the tests ran against.
#
#   scripts/ray.sh          install (idempotent)
#   scripts/ray.sh test     ... then the tests: a 3-raylet ray.cluster_utils.Cluster on
#                           this machine, stores and bridges per "node", vLLM's receiver
#                           on other nodes (python/tests_ray)
#   scripts/ray.sh bench    ... then the multi-node benchmark (docs/multinode.md)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/vllm.sh >/dev/null
venv=$PWD/python/.venv-vllm
"$venv/bin/python" -c "import ray; assert ray.__version__ == '2.60.0'" 2>/dev/null ||
  scripts/uv.sh pip install -q --python "$venv/bin/python" "ray==2.60.0"
case "${1:-}" in
  "") echo "installed: $venv/bin/python -c 'import shmstore.ray'" ;;
  test) shift; "$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests_ray "$@" ;;
  bench) shift; "$venv/bin/python" python/benchmarks/multinode.py "$@" ;;
  *) echo "usage: scripts/ray.sh [test|bench]" >&2; exit 2 ;;
esac
