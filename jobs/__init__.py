"""What every chunkq process shares, and the job a worker runs: ``embed.py`` (``embed_chunk``,
the one function the allow-list lets RQ call, at the dotted path queued jobs name), and
``calibrate.py`` (the child process submit asks for a run's int8 ranges, which encodes as a job).

Five rooms: ``contract/`` (what a run, a chunk and their files are; both sides read it),
``queue/`` (everything done with RQ, behind ``rq_api.py``), ``drills/`` (fault injection, tests and
drills only), ``compute/`` (how a worker turns a chunk into vectors: models, batches, the cache)
and ``kinds/`` (one module per kind of model behind ``kinds/contract.py``). Nothing here imports
from ``queue_worker`` or ``supervisor``.
"""
