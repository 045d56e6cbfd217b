"""The queue: everything chunkq does with RQ, behind one door. ``rq_api.py`` is the only module of
the product that imports ``rq``; the rest of this room is what chunkq does with it: the job's meta
(``jobmeta``), a run's chunks queued idempotently in a window (``enqueue``), what the supervisor's
tracker reads of a queue in bulk (``queue_lists``), a job given back (``queueing``), each run's own
queue and its turns among shared workers (``run_queues``), failing a dead worker's job
(``abandon``), a failed attempt's record (``attempt_records``), the job functions a worker may run
(``allowlist``), and the tripwire that refuses pickle (``nopickle``).

Imports ``contract/`` and its own modules: nothing of ``compute/`` or ``kinds/``, never torch. The
worker (``queue_worker/``) and the supervisor reach RQ only through this room.
"""
