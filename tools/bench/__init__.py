"""Benchmarks: each prints ratios against a physical limit or a peer measured in the same run."""
