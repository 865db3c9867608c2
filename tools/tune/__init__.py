"""Tile and launch tuners: they write the per-GPU tables ftserve_kernels/configs/ loads."""
