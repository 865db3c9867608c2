"""Speculative decoding: n-gram proposals from a request's own tokens (``ngram``),
drafts from a checkpoint's MTP layers (``mtp``), the acceptance rule
(``accept``), and the per-request state and back-off the scheduler consults,
one for both kinds (``speculator``)."""
