#!/usr/bin/env bash
# uv, the installer the project's Python environments are filled with (python/.venv,
# python/.venv-vllm, python/.venv-vllm-cpu): it downloads and unpacks in parallel, so the
# ~6 GB vLLM environments take seconds to minutes where pip took several minutes each
# (docs/verification.md, "CI"). It is installed with pip from the package index into
# python/.venv-uv the first time. The venvs themselves are plain `python -m venv` ones,
# with pip in them, as a user's would be.
#
#   scripts/uv.sh pip install --python VENV/bin/python PACKAGES...
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
export UV_NATIVE_TLS=${UV_NATIVE_TLS:-1}
# Bytecode at install time, as pip does: uv leaves it out by default, and with
# PYTHONDONTWRITEBYTECODE set (as on this machine) every process would then compile torch
# and vLLM from source at each import (the vLLM tests took 408 s instead of ~160 s).
export UV_COMPILE_BYTECODE=${UV_COMPILE_BYTECODE:-1}
exec "$tools/bin/uv" "$@"
