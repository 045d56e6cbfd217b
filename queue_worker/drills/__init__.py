"""Stand-ins for hardware, for tests and drills on hosts without GPUs: ``simulated_nvml`` answers as
NVML would from a JSON file named by ``CHUNKQ_SIMULATED_GPUS`` (GPUs, their memory and processes, a
failing NVML); ``devices/`` asks it only when that variable is set.

Imports ``jobs/`` only.
"""
