"""``python -m tools.loadgen``: arguments, model discovery, output files and the exit status.

Exit status: 0 = run finished (and, with --soak, every check passed); 1 = a soak check failed or no
measured request completed; 2 = bad arguments or the server is unreachable; 130 = Ctrl-C (the
summary of what was measured is still printed and written).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from typing import Any

import aiohttp

from tools.loadgen.plots import write_plots
from tools.loadgen.profiles import PROFILES, WorkloadConfig
from tools.loadgen.runner import RunConfig, Runner, RunResult
from tools.loadgen.soak import SoakConfig
from tools.loadgen.stats import format_table, summarize

# Used when neither --max-context nor the server's model card says how long a prompt may be.
FALLBACK_MAX_CONTEXT = 8192


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" only where there is a default to show and the help text does
    not already name it (argparse's own formatter also prints "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or default is False
                or "default" in text or action.option_strings == []):
            return text
        return f"{text} (default: {default})" if text else f"(default: {default})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.loadgen",
        description="Agentic multi-turn load and soak tests for OpenAI-compatible servers "
                    "(and Anthropic's Messages API).",
        formatter_class=_HelpFormatter,
    )
    a = p.add_argument
    a("--url", default="http://127.0.0.1:8000", help="server base URL")
    a("--model", default=None, help="model name (default: first of GET /v1/models)")
    a("--api-key", default=None, help="sent as a Bearer token (as x-api-key on /v1/messages)")
    a("--profile", choices=PROFILES, default="agentic",
      help="workload: agentic = multi-turn sessions that resend the whole conversation; "
           "shared-prefix = groups of requests over one long prompt; random = independent prompts; "
           "edit = rewrite a source file with one small change (output copies the prompt)")
    a("--seed", type=int, default=0, help="all generated content derives from it")
    g = p.add_argument_group("bounds and phases")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds of measurement after warm-up (default 60 without --max-requests)")
    g.add_argument("--max-requests", type=int, default=None, help="measured requests to send")
    g.add_argument("--warmup", type=float, default=0.0, help="seconds of unmeasured warm-up")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after the stop")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as failed")
    g = p.add_argument_group("workload")
    g.add_argument("--sessions", type=int, default=4, help="agentic: concurrent sessions")
    g.add_argument("--system-tokens", type=int, default=300, help="agentic: system prompt length")
    g.add_argument("--turn-tokens", type=float, default=200.0, help="agentic: mean new tokens per turn")
    g.add_argument("--tool-fraction", type=float, default=0.5, help="agentic: share of tool-output turns")
    g.add_argument("--max-context", type=int, default=None,
                   help="agentic: context ceiling (tokens, approximate: the client has no "
                        "tokenizer) before a session restarts; also caps prompt lengths elsewhere "
                        "(default: a tenth below the server's max_model_len from GET /v1/models, "
                        f"else {FALLBACK_MAX_CONTEXT}; a larger value is lowered the same way)")
    g.add_argument("--think-time", type=float, default=0.0, help="agentic: mean think seconds")
    g.add_argument("--subagents", type=int, default=0,
                   help="agentic: requests a fan-out turn sends at once (the conversation plus a "
                        "sub-task each); 0 or 1 = no fan-out")
    g.add_argument("--fanout-fraction", type=float, default=0.0,
                   help="agentic: share of turns that fan out to --subagents requests")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: number of shared prompts")
    g.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix: shared prompt length")
    g.add_argument("--file-tokens", type=int, default=2000,
                   help="edit: tokens of the source file each request hands over")
    g.add_argument("--input-tokens", type=float, default=256.0,
                   help="random/shared-prefix: mean unique prompt tokens")
    g.add_argument("--request-rate", type=float, default=None,
                   help="random/shared-prefix: Poisson req/s (default: closed loop)")
    g.add_argument("--concurrency", type=int, default=8,
                   help="random/shared-prefix: closed-loop workers, or the in-flight cap with a rate")
    g.add_argument("--endpoint", choices=("chat", "completions", "messages", "responses"), default="chat",
                   help="API: chat = /v1/chat/completions, messages = Anthropic's /v1/messages, "
                        "responses = OpenAI's /v1/responses (both: every profile), completions = /v1/completions (random/shared-prefix; "
                        "agentic then uses chat)")
    g.add_argument("--output-tokens", type=float, default=64.0, help="mean max_tokens per request")
    g.add_argument("--max-output-tokens", type=int, default=1024,
                   help="upper bound on a request's max_tokens")
    g.add_argument("--length-dist", choices=("lognormal", "pareto", "fixed"), default="lognormal",
                   help="distribution of prompt and output lengths around their means")
    g.add_argument("--length-sigma", type=float, default=1.0,
                   help="lognormal sigma; pareto alpha = 1 + 1/sigma")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of every request (canaries are greedy)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM/ftserve extension) so replies run to max_tokens")
    g.add_argument("--abort-rate", type=float, default=0.0,
                   help="fraction of requests the client drops mid-stream")
    g = p.add_argument_group("soak checks")
    g.add_argument("--soak", action="store_true",
                   help="check /health and /metrics, leaks after drain, canary outputs; fail on any violation")
    g.add_argument("--scrape-interval", type=float, default=1.0,
                   help="soak: seconds between /health and /metrics scrapes")
    g.add_argument("--settle-timeout", type=float, default=15.0,
                   help="seconds after drain for running requests and KV usage to reach baseline")
    g.add_argument("--max-rss-growth-mb", type=float, default=512.0,
                   help="soak: allowed growth of the server's resident memory over the run")
    g.add_argument("--kv-usage-tolerance", type=float, default=0.0,
                   help="allowed KV usage ratio above baseline after drain")
    g.add_argument("--max-errors", type=int, default=0, help="soak: failed requests allowed")
    g.add_argument("--server-pid", type=int, default=None,
                   help="read RSS from /proc/PID (else process_resident_memory_bytes)")
    g.add_argument("--canary-interval", type=float, default=None,
                   help="seconds between greedy canaries (default 5 with --soak, else off)")
    g.add_argument("--canary-compare", choices=("all", "idle"), default="all",
                   help="which canaries must match the first: all, or only those sent while "
                        "nothing else was in flight (engines that are not batch-invariant)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory for requests.jsonl, summary.json, plots")
    g.add_argument("--no-progress", action="store_true", help="no progress line while running")
    g.add_argument("--save-text", action="store_true", help="keep generated text in requests.jsonl")
    return p


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What GET /v1/models says about the model a run will drive."""

    name: str
    max_model_len: int | None  # None: the server does not say (not every server does)


async def discover_model(url: str, api_key: str | None, name: str | None) -> ServedModel:
    """The card of ``name`` (or of the first model listed) from GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(url + "/v1/models", headers=headers) as r:
            r.raise_for_status()
            data = await r.json(content_type=None)  # sglang-router's says text/plain
    cards = data["data"]
    card = next((c for c in cards if c.get("id") == name), None) if name else cards[0]
    if card is None:  # a name the server does not list: it may still route it
        return ServedModel(str(name), None)
    limit = card.get("max_model_len")
    return ServedModel(str(card["id"]), int(limit) if isinstance(limit, int) and limit > 0 else None)


def max_context_for(requested: int | None, served: int | None) -> int:
    """The ceiling a run keeps conversations under: the flag, else the server's limit, else
    the fallback. The server's limit is hard (a prompt plus max_tokens past it is a 400) and
    the client only estimates tokens, so a ceiling taken from it keeps a tenth below it; a
    flag past it is lowered the same way."""
    if served is None:
        return requested or FALLBACK_MAX_CONTEXT
    safe = served - served // 10
    if requested is None:
        return safe
    if requested > safe:
        print(f"loadgen: --max-context {requested} is past what the server's max_model_len "
              f"{served} leaves room for; using {safe}", file=sys.stderr)
        return safe
    return requested


def config_from_args(ns: argparse.Namespace, model: str) -> RunConfig:
    duration = ns.duration if (ns.duration is not None or ns.max_requests is not None) else 60.0
    workload = WorkloadConfig(
        profile=ns.profile, seed=ns.seed, model=model, endpoint=ns.endpoint,
        length_dist=ns.length_dist, length_sigma=ns.length_sigma, sessions=ns.sessions,
        system_tokens=ns.system_tokens, turn_tokens=ns.turn_tokens, tool_fraction=ns.tool_fraction,
        max_context=ns.max_context, think_time_s=ns.think_time, subagents=ns.subagents,
        fanout_fraction=ns.fanout_fraction, groups=ns.groups,
        prefix_tokens=ns.prefix_tokens, file_tokens=ns.file_tokens, input_tokens=ns.input_tokens,
        request_rate=ns.request_rate, concurrency=ns.concurrency, output_tokens=ns.output_tokens,
        max_output_tokens=ns.max_output_tokens, temperature=ns.temperature,
        ignore_eos=ns.ignore_eos,
    )
    soak = None
    if ns.soak:
        soak = SoakConfig(ns.scrape_interval, ns.settle_timeout, ns.max_rss_growth_mb,
                          ns.kv_usage_tolerance, ns.max_errors, ns.server_pid)
    canary = ns.canary_interval if ns.canary_interval is not None else (5.0 if ns.soak else 0.0)
    return RunConfig(
        url=ns.url.rstrip("/"), workload=workload, duration_s=duration,
        max_requests=ns.max_requests, warmup_s=ns.warmup, drain_timeout_s=ns.drain_timeout,
        request_timeout_s=ns.request_timeout, abort_rate=ns.abort_rate, api_key=ns.api_key,
        progress_interval_s=0.0 if ns.no_progress else 1.0, soak=soak, canary_interval_s=canary,
        canary_compare=ns.canary_compare,
    )


def _validate(ns: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not 0.0 <= ns.abort_rate <= 1.0:
        p.error("--abort-rate must be in [0, 1]")
    if ns.duration is not None and ns.duration <= 0:
        p.error("--duration must be > 0")
    if ns.max_requests is not None and ns.max_requests < 1:
        p.error("--max-requests must be >= 1")
    if ns.request_rate is not None and ns.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if ns.file_tokens < 1:
        p.error("--file-tokens must be >= 1")
    if min(ns.sessions, ns.concurrency, ns.groups) < 1:
        p.error("--sessions, --concurrency and --groups must be >= 1")
    if ns.subagents < 0 or not 0.0 <= ns.fanout_fraction <= 1.0:
        p.error("--subagents must be >= 0 and --fanout-fraction in [0, 1]")


def write_outputs(out: str, cfg: RunConfig, res: RunResult, summary: dict[str, Any],
                  save_text: bool) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "requests.jsonl"), "w") as f:
        for r in [*res.records, *res.canaries]:
            f.write(json.dumps(r.to_json(with_text=save_text)) + "\n")
    doc = {
        "config": dataclasses.asdict(cfg) | {"api_key": None},
        "summary": summary,
        "interrupted": res.interrupted,
        "violations": res.violations,
        "soak": res.soak.report() if res.soak else None,
        "canaries": [{"t": c.start, "status": c.status, "text": c.text,
                      "output_tokens": c.output_tokens} for c in res.canaries],
        "metrics_timeseries": [
            {"t": s.t, "healthy": s.healthy, "rss": s.rss, **s.metrics}
            for s in (res.soak.snapshots if res.soak else [])
        ],
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plots = write_plots(out, res.records, res.soak.snapshots if res.soak else [])
    print(f"wrote {out}/requests.jsonl, summary.json" + (f", {', '.join(plots)}" if plots else ""))


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    _validate(ns, p)
    url = ns.url.rstrip("/")
    try:
        served = asyncio.run(discover_model(url, ns.api_key, ns.model))
    except (aiohttp.ClientError, OSError, TimeoutError, KeyError, IndexError, ValueError,
            TypeError) as e:
        if ns.model is None:
            print(f"loadgen: cannot reach {url}/v1/models: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        served = ServedModel(ns.model, None)  # named model: run without the card
    ns.max_context = max_context_for(ns.max_context, served.max_model_len)
    cfg = config_from_args(ns, served.name)

    async def go() -> RunResult:
        return await Runner(cfg).run()

    res = asyncio.run(go())
    summary = summarize(res.records, res.measure_duration_s)
    if res.soak and summary["failed"] > cfg.soak.max_errors:  # type: ignore[union-attr]
        res.violations.append(
            f"{summary['failed']} failed requests (allowed --max-errors {cfg.soak.max_errors}): "  # type: ignore[union-attr]
            f"{summary['errors']}"
        )
    title = f"ftserve loadgen: {cfg.workload.profile}" + (" (INTERRUPTED)" if res.interrupted else "")
    print(format_table(summary, title))
    if res.soak:
        rep = res.soak.report()
        growth = rep["rss_growth_mb"]
        print(f"soak: {rep['num_scrapes']} scrapes, {len(res.canaries)} canaries, RSS growth "
              + (f"{growth:.1f} MiB" if growth is not None else "unknown"))
    if ns.out:
        write_outputs(ns.out, cfg, res, summary, ns.save_text)
    if res.interrupted:
        print("loadgen: interrupted; the numbers above cover what was measured", file=sys.stderr)
        return 130
    if res.violations:
        print("SOAK FAILED:", file=sys.stderr)
        for v in res.violations:
            print(f"  - {v}", file=sys.stderr)
        return 1
    if summary["completed"] + summary["aborted"] == 0:
        print("loadgen: no measured request completed", file=sys.stderr)
        return 1
    if res.soak:
        print("soak: all checks passed")
    return 0
