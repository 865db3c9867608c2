"""The sampling fields every protocol takes with /v1/chat/completions' meaning
(OpenAI's names; Anthropic's and the Responses API's bodies take them too, some as
ftserve extensions), and the stop strings. Their ranges are SamplingParams.validate's,
checked once the prompt's length is known; here the integers are bounded so that no
absurd one reaches a device tensor."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from ftserve.api.validation import Body, Int, Worded, reject

I32 = 2**31 - 1


def _stop(value: str | list[str]) -> tuple[str, ...]:
    """A string or a list of at most 16 non-empty strings."""
    stops = [value] if isinstance(value, str) else value
    if len(stops) > 16:
        raise reject("'{at}' may hold at most 16 strings")
    if any(s == "" for s in stops):
        raise reject("'{at}' strings must not be empty")
    return tuple(stops)


Stop = Annotated[str | list[str], Worded("'{at}' must be a string or a list of strings"),
                 AfterValidator(_stop)]


class Sampling(Body):
    """The sampling fields /v1/messages and /v1/responses take too (SamplingParams
    kwargs; their ranges are SamplingParams.validate's)."""

    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: Int(-1, I32) | None = None
    seed: Int(-(2**63), 2**63 - 1) | None = None
    min_tokens: Int(0, I32) | None = None
    ignore_eos: bool | None = None

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams kwargs given (ignore_eos always)."""
        out = {key: getattr(self, key) for key in _SAMPLED if getattr(self, key) is not None}
        out["ignore_eos"] = bool(self.ignore_eos)
        return out


_SAMPLED = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "top_k", "seed", "min_tokens")
