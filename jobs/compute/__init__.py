"""The computation a worker does for a chunk: loading and identifying a model, tokenising and
batching (by count or token budget), late chunking, quantising, the vector cache, device memory and
busy shares, what a run learned of its batch sizes, and the injected faults the tests use.

Imports ``contract/`` and ``kinds/``; torch only inside functions a worker calls (the supervisor
reads model identities and the cache from here without importing it).
"""
