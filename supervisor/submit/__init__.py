"""From a corpus to queued chunks: a run's identity, windows of long texts, the vector cache's plan
(which rows need encoding), the chunk inputs and the jobs.

Imports ``corpus/`` (the corpus read as records) and ``result/`` (a run already published is
answered from its result).
"""
