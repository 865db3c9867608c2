"""Per-request sampling parameters, validated once when a request arrives."""

from __future__ import annotations

from dataclasses import dataclass

# Stop ids travel to the sampler in a fixed-width per-slot row (masked while a
# request is below min_tokens); the sampler's width leaves room for eos ids.
MAX_STOP_TOKEN_IDS = 64
# logit_bias entries per request: a fixed-width per-slot row in the sampler too.
MAX_LOGIT_BIAS = 300


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (OpenAI field name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None = off; N = chosen token + N alternatives
    # None = off; N: each prompt token's logprob given the tokens before it, and
    # the N best alternatives there (completions echo + logprobs, vLLM's
    # prompt_logprobs). Such a request computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field."""
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", "max_tokens must be at least 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", "min_tokens must be in [0, max_tokens]")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingParamsError("temperature", "temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1:
            raise SamplingParamsError("top_k", "top_k must be -1, 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", "min_p must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError("presence_penalty", "presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError("frequency_penalty", "frequency_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError("repetition_penalty", "repetition_penalty must be in (0, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("top_logprobs", "top_logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs must be in [0, 20]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise SamplingParamsError("seed", "seed must fit in 64 bits")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are supported")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries are supported")
        for t, b in self.logit_bias:
            if not -100.0 <= b <= 100.0:
                raise SamplingParamsError("logit_bias", f"logit_bias for token {t} must be in [-100, 100]")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise SamplingParamsError("stop_token_ids", f"stop token id {t} is out of range")
            for t, _ in self.logit_bias:
                if not 0 <= t < vocab_size:
                    raise SamplingParamsError("logit_bias", f"logit_bias token id {t} is out of range")
