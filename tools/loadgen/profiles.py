"""Workload profiles: what each request contains and when it is sent.

- agentic: S closed-loop sessions; every turn resends the whole conversation plus a new user or
  tool message of heavy-tailed length; the assistant's streamed reply is appended; a session that
  would pass --max-context restarts with a fresh conversation; lognormal think time between turns.
  With --subagents K, a --fanout-fraction share of turns instead sends K requests at once, the
  conversation so far plus a different short sub-task each (sub-agents fanning out); their
  replies, joined, become the assistant turn.
- shared-prefix: G groups, each with its own long system prompt; each request is one group's
  prompt plus a unique question.
- random: independent prompts; Poisson arrivals at --request-rate, else --concurrency closed loops.
- edit: code-edit replay: each request hands the model a source file of about --file-tokens
  tokens and one small change to make (rename a function, change a constant, add a line) and
  asks for the whole file back, with max_tokens for all of it; nearly every output token is a
  copy from the prompt (what n-gram speculation is for). Arrivals as for random.

Every request's content comes from ``random.Random`` seeded by (seed, profile, session or index),
so the same --seed sends the same conversations whatever the timing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tools.loadgen import textgen
from tools.loadgen.client import RequestRecord, RequestSpec

PROFILES = ("agentic", "shared-prefix", "random", "edit")
SUBTASK_TOKENS = 24  # a fan-out sub-task's estimated length (the ceiling leaves twice this)


@dataclass(frozen=True)
class WorkloadConfig:
    profile: str = "agentic"
    seed: int = 0
    model: str = ""
    # chat | messages (Anthropic) | responses (OpenAI's Responses API) | completions (random / shared-prefix only; agentic sends chat)
    endpoint: str = "chat"
    length_dist: str = "lognormal"  # lognormal | pareto | fixed
    length_sigma: float = 1.0
    # agentic
    sessions: int = 4
    system_tokens: int = 300
    turn_tokens: float = 200.0  # mean new tokens per user/tool turn
    tool_fraction: float = 0.5  # share of turns that are tool outputs (code / JSON)
    max_context: int = 8192  # conversation ceiling in tokens, then the session restarts
    think_time_s: float = 0.0  # mean seconds between a reply and the next turn (lognormal)
    subagents: int = 0  # > 1: requests sent at once on a fan-out turn
    fanout_fraction: float = 0.0  # share of turns that fan out
    # shared-prefix
    groups: int = 4
    prefix_tokens: int = 1000
    # edit
    file_tokens: int = 2000
    # random / shared-prefix
    input_tokens: float = 256.0
    request_rate: float | None = None  # req/s Poisson; None = closed loop at `concurrency`
    concurrency: int = 8
    # all
    output_tokens: float = 64.0  # mean max_tokens per request
    max_output_tokens: int = 1024
    temperature: float = 1.0
    ignore_eos: bool = False


class Issuer(Protocol):
    """What a profile needs from the runner."""

    @property
    def stopping(self) -> bool: ...

    async def issue(self, spec: RequestSpec) -> RequestRecord | None:
        """Send ``spec``; None once the run is stopping (the profile should return)."""
        ...


def _chat_endpoint(cfg: WorkloadConfig) -> str:
    """Where a conversation goes: /v1/messages or /v1/responses when asked, else chat
    completions."""
    return cfg.endpoint if cfg.endpoint in ("messages", "responses") else "chat"


def _sampling(cfg: WorkloadConfig, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": textgen.draw_length(
            rng, cfg.output_tokens, cfg.length_dist, cfg.length_sigma, cfg.max_output_tokens
        ),
        "temperature": cfg.temperature,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM / ftserve extension; OpenAI itself would reject it
    return body


def _draw(cfg: WorkloadConfig, rng: random.Random, mean: float, cap: int) -> int:
    return textgen.draw_length(rng, mean, cfg.length_dist, cfg.length_sigma, max(1, cap))


async def _think(cfg: WorkloadConfig, rng: random.Random) -> None:
    if cfg.think_time_s > 0:
        await asyncio.sleep(rng.lognormvariate(-0.5, 1.0) * cfg.think_time_s)  # E = think_time_s


def _fit(content: str, est: float, room: float) -> str:
    """Cut ``content`` to about ``room`` tokens when its estimate ``est`` is over."""
    if est <= room:
        return content
    words = content.split(" ")
    return " ".join(words[: max(1, int(len(words) * room / est))])


async def _agentic_session(cfg: WorkloadConfig, issuer: Issuer, sid: int, system: str) -> None:
    gen = 0
    scale = 1.0  # server tokens per estimated token, learned from usage.prompt_tokens
    while not issuer.stopping:
        rng = random.Random(f"{cfg.seed}:agentic:{sid}:{gen}")
        gen += 1
        first = textgen.user_turn(rng, _draw(cfg, rng, cfg.turn_tokens, cfg.max_context // 4))
        messages: list[dict[str, str]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
        ]
        context = scale * sum(textgen.approx_tokens(m["content"]) for m in messages)
        turn = 0
        while True:
            body = _sampling(cfg, rng)
            fan = cfg.subagents if cfg.subagents > 1 and rng.random() < cfg.fanout_fraction else 1
            # Leave room for the reply (and a fan-out's sub-task) inside the ceiling.
            extra = int(2 * scale * SUBTASK_TOKENS) if fan > 1 else 0
            body["max_tokens"] = max(1, min(body["max_tokens"], cfg.max_context - int(context) - extra))
            rec, reply = await _turn(cfg, issuer, rng, body, messages, sid, turn, fan)
            if rec is None:
                return
            if rec.status == "error":
                await asyncio.sleep(0.5)  # do not spin on a failing server; restart the session
                break
            if rec.prompt_tokens:
                est = sum(textgen.approx_tokens(m["content"]) for m in messages)
                scale = max(0.25, min(4.0, rec.prompt_tokens / est))
                context = float(rec.prompt_tokens)
            messages.append({"role": "assistant", "content": reply})
            context += max(rec.output_tokens, scale * textgen.approx_tokens(reply))
            # The ceiling must hold for the next prompt plus its reply; 32 tokens of slack
            # cover the chat template's per-message overhead (plus a possible sub-task).
            # 0.8: one message's estimate can be ~30% off even after the session's rescaling.
            slack = 32 + (2 * scale * SUBTASK_TOKENS if cfg.subagents > 1 else 0)
            room = 0.8 * (cfg.max_context - context - cfg.max_output_tokens - slack)
            if room < 16:
                break  # ceiling reached: a fresh conversation
            n = _draw(cfg, rng, cfg.turn_tokens, int(room / scale))
            if rng.random() < cfg.tool_fraction:
                content = textgen.tool_output(rng, n)
            else:
                content = textgen.user_turn(rng, n)
            content = _fit(content, scale * textgen.approx_tokens(content), room)
            # Tool results go in as user messages: a bare "tool" role needs a matching
            # tool_calls entry that the synthetic assistant never produced.
            messages.append({"role": "user", "content": content})
            context += scale * textgen.approx_tokens(content)
            turn += 1
            await _think(cfg, rng)


async def _turn(cfg: WorkloadConfig, issuer: Issuer, rng: random.Random, body: dict[str, Any],
                messages: list[dict[str, str]], sid: int, turn: int,
                fan: int) -> tuple[RequestRecord | None, str]:
    """One turn: a request (fan = 1), or ``fan`` sent at once, each the conversation plus its
    own sub-task. Returns the record the session learns from (the first that did not fail;
    None once the run stops) and the assistant text to append."""
    if fan == 1:
        rec = await issuer.issue(RequestSpec(_chat_endpoint(cfg), {**body, "messages": list(messages)},
                                             "agentic", sid, turn))
        return rec, (rec.text if rec is not None else "") or "(no reply)"
    tasks = [textgen.user_turn(rng, SUBTASK_TOKENS) for _ in range(fan)]
    specs = [RequestSpec(_chat_endpoint(cfg), {**body, "messages": [*messages, {"role": "user", "content": t}]},
                         "agentic-fanout", sid, turn) for t in tasks]
    recs = await asyncio.gather(*(issuer.issue(spec) for spec in specs))
    if any(r is None for r in recs):
        return None, ""
    ok = [r for r in recs if r is not None and r.status != "error"]
    first = ok[0] if ok else recs[0]
    # The sub-agents' answers, joined: what the orchestrating agent would write next.
    reply = "\n".join(r.text for r in ok if r.text) or "(no reply)"
    return first, reply


def _independent_spec(cfg: WorkloadConfig, i: int, prefixes: list[str]) -> RequestSpec:
    rng = random.Random(f"{cfg.seed}:{cfg.profile}:{i}")
    n = _draw(cfg, rng, cfg.input_tokens, cfg.max_context)
    body = _sampling(cfg, rng)
    group = -1
    if prefixes:
        group = rng.randrange(len(prefixes))
        system, question = prefixes[group], textgen.user_turn(rng, n)
    else:
        system, question = "", textgen.user_turn(rng, n)
    if cfg.endpoint != "completions":
        msgs = ([{"role": "system", "content": system}] if system else [])
        body["messages"] = [*msgs, {"role": "user", "content": question}]
    else:
        body["prompt"] = (system + "\n\n" + question) if system else question
    return RequestSpec(cfg.endpoint, body, cfg.profile, group, i)


EDIT_SYSTEM = ("You are a code editor. Apply the requested change to the file and reply with the "
               "complete edited file in one ```python block, and nothing else.")


def _edit_spec(cfg: WorkloadConfig, i: int) -> RequestSpec:
    """Request i of the edit profile: its own file and change (from (seed, i)); max_tokens
    leaves room for the whole file plus a quarter (the estimate's error, the fences), within
    --max-context (--output-tokens and --max-output-tokens do not apply)."""
    rng = random.Random(f"{cfg.seed}:edit:{i}")
    source = textgen.source_file(rng, cfg.file_tokens)
    instruction, _ = textgen.small_edit(rng, source)
    body = _sampling(cfg, rng)
    user = f"Here is `module_{i}.py`:\n```python\n{source}```\n\n{instruction}"
    est = textgen.approx_tokens(source)
    room = cfg.max_context - int(1.1 * (est + textgen.approx_tokens(EDIT_SYSTEM + instruction))) - 64
    body["max_tokens"] = max(1, min(int(1.25 * est) + 32, room))
    if cfg.endpoint == "completions":
        body["prompt"] = f"{EDIT_SYSTEM}\n\n{user}\n\n```python\n"
    else:
        body["messages"] = [{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": user}]
        if cfg.endpoint != "responses":
            # The reply starts inside the code block, as an editor's does (Anthropic's
            # assistant prefill; vLLM's and ftserve's continue_final_message on chat).
            body["messages"].append({"role": "assistant", "content": "```python\n"})
            if cfg.endpoint == "chat":
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
    return RequestSpec(cfg.endpoint, body, cfg.profile, -1, i)


async def _open_or_closed_loop(
    cfg: WorkloadConfig, issuer: Issuer, make: Callable[[int], RequestSpec]
) -> None:
    counter = iter(range(1 << 62))
    if cfg.request_rate is None:
        async def worker() -> None:
            while not issuer.stopping:
                if await issuer.issue(make(next(counter))) is None:
                    return

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        return
    # Poisson arrivals, capped at `concurrency` in flight so an overloaded server cannot make the
    # client open unbounded connections.
    rng = random.Random(f"{cfg.seed}:arrivals")
    sem = asyncio.Semaphore(cfg.concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def one(spec: RequestSpec) -> None:
        async with sem:
            await issuer.issue(spec)

    while not issuer.stopping:
        await asyncio.sleep(rng.expovariate(cfg.request_rate))
        if issuer.stopping:
            break
        t = asyncio.create_task(one(make(next(counter))))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


def build(cfg: WorkloadConfig, issuer: Issuer) -> Awaitable[Any]:
    """The coroutine that drives ``cfg.profile`` until ``issuer.stopping``."""
    if cfg.profile == "agentic":
        system = textgen.system_prompt(random.Random(f"{cfg.seed}:system"), cfg.system_tokens)
        return asyncio.gather(
            *(_agentic_session(cfg, issuer, sid, system) for sid in range(cfg.sessions))
        )
    if cfg.profile == "shared-prefix":
        prefixes = [
            textgen.system_prompt(random.Random(f"{cfg.seed}:prefix:{g}"), cfg.prefix_tokens)
            for g in range(cfg.groups)
        ]
        return _open_or_closed_loop(cfg, issuer, lambda i: _independent_spec(cfg, i, prefixes))
    if cfg.profile == "random":
        return _open_or_closed_loop(cfg, issuer, lambda i: _independent_spec(cfg, i, []))
    if cfg.profile == "edit":
        return _open_or_closed_loop(cfg, issuer, lambda i: _edit_spec(cfg, i))
    raise ValueError(f"unknown profile {cfg.profile!r}; choose one of {', '.join(PROFILES)}")
