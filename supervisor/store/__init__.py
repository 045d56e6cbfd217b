"""The bookkeeping of a store and its Redis: the ledger of finished chunks and the rate it sums,
the store's and a run's locks, the embedded Redis server and the one a store advertises, sets of
chunk numbers, the run's log file and the marks of its start.

Imports nothing of the other rooms.
"""
