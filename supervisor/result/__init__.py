"""A run's result: assembling the chunk outputs in row order (the plan's row map read back, the
windows pooled per text), writing it whole, then reading and verifying a published one.

Imports ``store/``.
"""
