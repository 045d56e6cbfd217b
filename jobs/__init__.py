"""The contract every chunkq process shares: specs, store layout, errors and the job functions.

Nothing here imports from ``queue_worker`` or ``supervisor``.
"""
