"""Submits corpora, watches runs, assembles and verifies results. The ``chunkq`` command line is
``chunkq/cli/``, the tools that read runs ``chunkq/tools/``.

Six rooms, each importing only the rooms before it: ``corpus/`` (a corpus file read as records,
a run's corpus files) <- ``store/`` (the store's and Redis's bookkeeping) <- ``server/`` (the
Redis that serves a store) <- ``result/``
(assembling, verifying and reading a result) <- ``submit/`` (a run's identity, its plan and its
queued chunks) <- ``watch/`` (a run watched to its end). Beside them, what the commands ask for:
``request.py`` and ``run_options.py``, and ``local_run.py`` (``chunkq run``: all six on one
machine).
"""
