"""Compute kernels: an op registry (specserve/kernels/registry.py), torch references, the CPU
engine's C++ extension (specserve/kernels/cpu)."""

