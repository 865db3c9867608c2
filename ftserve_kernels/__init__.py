"""Triton kernels with torch reference twins.

Every kernel module exposes a ``*_ref`` function written in plain torch (runs on
the CPU, used by CI and as the oracle in tests) and, where it pays, a Triton
kernel with the same signature. Triton kernels are tested on the CPU under
``TRITON_INTERPRET=1`` at small shapes and on the GPU by ``gpu``-marked tests.
"""
