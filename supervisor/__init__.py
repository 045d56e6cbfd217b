"""Submits corpora, watches runs, assembles and verifies results. The ``chunkq`` command line is
``chunkq/cli/``, the tools that read runs ``chunkq/tools/``."""
