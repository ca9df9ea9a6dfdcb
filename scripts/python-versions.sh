#!/usr/bin/env bash
# The abi3 wheel's tests under every CPython newer than 3.11 found on this machine (the
# package asks for >= 3.11; the test command and the `wheel` stage use 3.11): each one
# gets a clean venv with the wheel and its test extras, as `scripts/python.sh wheel`
# does. Looks in /usr/bin, /usr/local/bin and pyenv's versions; says so and succeeds
# where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A seen=()
found=()
for p in /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9] \
  "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python; do
  [ -x "$p" ] || continue
  v=$("$p" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
  [ -z "${seen[$v]:-}" ] || continue
  seen[$v]=1
  found+=("$p")
done
if [ ${#found[@]} -eq 0 ]; then
  echo "no CPython newer than 3.11 on this machine: only 3.11 is tested"
  exit 0
fi
for p in "${found[@]}"; do
  echo "== $("$p" --version) ($p)"
  PYTHON=$p scripts/python.sh wheel
done
