"""``python -m shmstore ...``: the ``shmstore`` command, for environments whose scripts
directory is not on the PATH (a container that runs ``python3 -m vllm...``, say)."""

from shmstore._cli import main

main()
