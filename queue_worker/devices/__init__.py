"""The devices a pool runs on: which GPUs there are and which a worker may use (NVML, or the CUDA
driver where NVML fails; ``simulated_nvml`` stands in for NVML in tests and drills), the CUDA build
of the installed torch, the CPU cores, and how busy each GPU is.

Imports ``jobs/``, ``drills/`` (NVML's stand-in, when a drill names one) and its own modules:
nothing of ``processes/`` or the worker, never torch at import
(a pool that only surveys its GPUs stays light).
"""
