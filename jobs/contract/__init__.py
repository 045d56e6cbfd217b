"""The contract: what a run, a chunk job and their files are, for the supervisor that writes them
and the worker that reads them alike. Specs and fingerprints, the run manifest, the store's layout
and how a file lands whole, the chunk outputs and their verification, the error classes and the
settled-chunk event (the job's meta, the allow-list and everything else RQ touches: ``queue/``).

Imports only its own modules: nothing of ``queue/``, ``compute/`` or ``kinds/``, and never torch
(the supervisor imports all of it and stays free of torch).
"""
