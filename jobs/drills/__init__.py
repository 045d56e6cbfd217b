"""Fault drills, for tests and drills only: ``faults`` injects a real fault's own words and conditions
(an OOM, a broken CUDA context, a hung or non-finite batch, each quoted from the library that raises
it) into a worker when ``CHUNKQ_FAULTS`` holds rules; off, it costs one check. Nothing of the
product's path depends on this room but the calls that let a drill in.

Imports ``contract/`` only.
"""
