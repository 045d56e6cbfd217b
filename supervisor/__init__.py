"""Submits corpora, watches runs, assembles and verifies results; home of the ``chunkq`` CLI."""
