"""Speculative decoding: n-gram proposals from a request's own tokens (``ngram``),
the acceptance rule (``accept``), and the per-request state and back-off the
scheduler consults (``speculator``)."""
