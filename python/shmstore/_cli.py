"""The ``shmstore`` command (a console script of the package).

It runs the command-line tool the wheel carries, ``shmstore/_bin/shmstore`` (the Rust
binary that ``cargo run -- ...`` runs in the source tree), in place of this process: so
``shmstore stat NAME``, ``check``, ``recover`` and the rest work wherever
``pip install shmstore`` did, with no Rust toolchain. ``shmstore bench`` works too: its
worker processes start the binary itself, not Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Where the wheel puts the tool (scripts/cli-into-package.sh packs it before each build).
BINARY = Path(__file__).with_name("_bin") / "shmstore"


def main() -> None:
    """Replaces this process with the tool, passing the arguments on."""
    if not os.access(BINARY, os.X_OK):
        sys.stderr.write(
            f"shmstore: this install has no command-line tool ({BINARY} is missing): it was "
            "built from source without it. Build the package with scripts/python.sh (which "
            "packs it), or install the tool alone with `cargo install --path .` in the "
            "shmstore source tree.\n"
        )
        sys.exit(1)
    # argv[0] is the name clap prints in usage lines.
    os.execv(BINARY, ["shmstore", *sys.argv[1:]])
