"""The bookkeeping of a store: the ledger of finished chunks and the rate it sums, the store's and
a run's locks, sets of chunk numbers, the run's log file and the marks of its start (the Redis
that serves a store: ``server/``).

Imports nothing of the other rooms.
"""
