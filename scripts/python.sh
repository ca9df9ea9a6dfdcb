#!/usr/bin/env bash
# The Python package: builds shmstore's bindings and installs them into python/.venv
# (created if missing, with maturin, numpy, pytest and prometheus_client from PyPI, installed
# with uv: scripts/uv.sh).
#
#   scripts/python.sh           build + install (release build)
#   scripts/python.sh test      ... then run the pytest suite (python/tests)
#   scripts/python.sh bench     ... then the Python-overhead benchmark
#   scripts/python.sh example   ... then examples/vllm_like.py (engine + 2 workers)
#   scripts/python.sh typecheck ... then mypy (package, tests, examples) and stubtest
#                               (python/shmstore/_native.pyi against the built module)
#   scripts/python.sh plot ARGS ... then scripts/plot.py ARGS (matplotlib installed first)
#   scripts/python.sh wheel     builds the abi3 wheel (target/wheels), installs it into a
#                               clean venv and runs the tests there: no Rust toolchain on
#                               the PATH, from a directory outside the source tree
#
# Every build packs the `shmstore` command-line tool into the package first
# (scripts/cli-into-package.sh): `pip install` gives the `shmstore` command too.
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
pip=(scripts/uv.sh pip install -q --python "$venv/bin/python")
"${pip[@]}" "maturin>=1.7,<2" "numpy>=1.24" "pytest>=7" "prometheus_client>=0.17"
scripts/cli-into-package.sh
(cd python && VIRTUAL_ENV=$venv "$venv/bin/maturin" develop --release -q)
case "${1:-}" in
  "") echo "installed: $venv/bin/python -c 'import shmstore'" ;;
  test) shift; "$venv/bin/python" -m pytest -q python/tests "$@" ;;
  bench) shift; "$venv/bin/python" python/benchmarks/overhead.py "$@" ;;
  example) shift; "$venv/bin/python" examples/vllm_like.py "$@" ;;
  plot)
    shift
    "${pip[@]}" "matplotlib>=3.7"
    "$venv/bin/python" scripts/plot.py "$@"
    ;;
  typecheck)
    "${pip[@]}" "mypy>=1.10"
    (cd python && "$venv/bin/mypy")
    (cd python && "$venv/bin/python" -m mypy.stubtest shmstore._native)
    ;;
  wheel)
    rm -rf target/wheels
    (cd python && "$venv/bin/maturin" build --release -q -o "$root/target/wheels")
    wheel=$(ls target/wheels/shmstore-*-cp311-abi3-*.whl)
    echo "built $wheel"
    clean=$root/target/wheel-venv
    rm -rf "$clean"
    "$("$py" -c 'import sys; print(sys.executable)')" -m venv "$clean"
    # The test extras at the versions the other venvs use (scripts/uv.sh, "Pinned").
    "$clean/bin/pip" install -q --disable-pip-version-check \
      --constraint python/constraints/venv.txt "$wheel[test]"
    # The tests alone, copied where no source tree can shadow the installed package, run
    # with a PATH that has no Rust toolchain: the `shmstore` command they run is the one
    # the wheel installed (tests/test_cli.py).
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cp -r python/tests "$work/tests"
    (cd "$work" && env PATH="$clean/bin:/usr/bin:/bin" \
      sh -c '! command -v cargo >/dev/null && ! command -v rustc >/dev/null || { echo "a Rust toolchain is on the PATH" >&2; exit 1; }
             python -c "import shmstore, sys; assert \"site-packages\" in shmstore.__file__, shmstore.__file__; print(\"testing\", shmstore.__file__)"
             python -m pytest -q -p no:cacheprovider tests')
    ;;
  *) echo "usage: scripts/python.sh [test|bench|example|plot|typecheck|wheel]" >&2; exit 2 ;;
esac
