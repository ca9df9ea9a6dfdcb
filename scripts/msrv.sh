#!/usr/bin/env bash
# The oldest Rust the README promises (`rust-version` in Cargo.toml) builds every target:
# the library, the `shmstore` tool, tests, examples and benchmarks (the kill-point build
# included), and the Python bindings. Installs that toolchain the first time (~30 s).
#
# Built, not run: what breaks on an older compiler is the build, mostly through the
# dependency versions Cargo.lock pins (a release that needs a newer compiler stops it with
# "requires rustc 1.88"; session 31 found proptest 1.12 doing that to the tests).
# `[workspace] resolver = "3"` keeps `cargo update` from locking such a release again.
# Loom (built only with `--cfg loom`, CI's own stage) is not covered: its `generator`
# dependency follows the newest stable Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
[ -n "$msrv" ] || { echo "no rust-version in Cargo.toml" >&2; exit 1; }
py_msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' python/Cargo.toml | head -1)
[ "$py_msrv" = "$msrv" ] || { echo "python/Cargo.toml says rust-version $py_msrv, Cargo.toml $msrv" >&2; exit 1; }
rustup toolchain list | grep -q "^$msrv" || rustup toolchain install "$msrv" --profile minimal
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/msrv}
echo "Rust $msrv ($(rustc +"$msrv" --version))"
cargo +"$msrv" check --locked --all-targets --features kill-points
# abi3: any CPython >= 3.11 will do for the check; the one the test command made, if any.
python=python/.venv/bin/python
[ -x "$python" ] || python=python3
PYO3_PYTHON=$python cargo +"$msrv" check --locked --manifest-path python/Cargo.toml
echo "every target builds with Rust $msrv"
