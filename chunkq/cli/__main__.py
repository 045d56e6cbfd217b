"""``python -m chunkq.cli``, as ``chunkq``."""

from chunkq.cli import main

main()
