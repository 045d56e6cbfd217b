"""Submits corpora, watches runs, assembles and verifies results. The ``chunkq`` command line is
``chunkq/cli/``, the tools that read runs ``chunkq/tools/``.

Four rooms, each importing only the rooms before it: ``store/`` (the store's and Redis's
bookkeeping) <- ``result/`` (assembling, verifying and reading a result) <- ``submit/`` (reading,
planning and queueing a corpus) <- ``watch/`` (a run watched to its end). Beside them, what the
commands ask for: ``request.py`` and ``run_options.py``, and ``local_run.py`` (``chunkq run``: all
four on one machine).
"""
