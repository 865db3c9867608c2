"""ftserve: a single-box LLM serving engine for Mixture-of-Experts models."""

__version__ = "0.1.0"
