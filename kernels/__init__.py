"""Triton kernels, each paired with a pure-torch reference in the same module."""
