#!/usr/bin/env bash
# Packs the `shmstore` command-line tool into the Python package: builds it (release) and
# puts it, without its debug info, at python/shmstore/_bin/shmstore (gitignored), which the
# wheel carries (`include` in python/pyproject.toml) and the `shmstore` console script runs
# (python/shmstore/_cli.py). So `pip install shmstore` gives `shmstore stat | ls | check |
# recover | rm | metrics | bench` too. Run by every script that builds the package
# (python.sh, vllm.sh, vllm-serve.sh) before maturin.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin shmstore
dest=python/shmstore/_bin
mkdir -p "$dest"
# Symbols stay (a panic's backtrace names its functions); line tables go: 2.4 MB, not 16.
if command -v strip >/dev/null; then
  strip --strip-debug -o "$dest/shmstore.tmp" target/release/shmstore
else
  cp target/release/shmstore "$dest/shmstore.tmp"
fi
chmod 755 "$dest/shmstore.tmp"
mv -f "$dest/shmstore.tmp" "$dest/shmstore"
