"""Tests of the commands, exports, sinks, the dashboard and the Python API (chunkq/)."""
