"""The computation a worker does for a chunk: which model a name means and loading and identifying
it, tokenising and batching (by count or token budget), late chunking, quantising, the vector
cache, device memory and busy shares, and what a run learned of its batch sizes.

Imports ``contract/``, ``drills/`` (the faults a drill injects) and ``kinds/`` (the class a kind
loads with, its warm-up), which in turn use the batching here: the two rooms use each other, no
module of them does so in a circle (``tests/house/test_layers.py``). Torch only inside functions a
worker calls (the supervisor reads model identities and the cache from here without importing it).
"""
