"""The Redis a store is served by: ``embedded_redis`` (the Valkey server ``chunkq run`` and
``chunkq serve-redis`` start in the store, on a free loopback port, with a generated password and
an append-only file) and ``store_redis`` (the server a store advertises to the commands that read it,
and taking over a dead run's).

Imports ``store/`` (the store's lock) and ``jobs/``, and the pool's way of stopping a child
(``queue_worker/processes``); nothing of the rooms after it.
"""
