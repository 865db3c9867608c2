"""The variant model of tools/bench/decode_variants: which batch-1 decode
kernel variants there are, how a run's rows are ranked and combined, and the
markdown table. No GPU here (tests/test_bench_decode_variants.py runs it on
the CPU); the measurement loop lives in tools/bench/decode_variants.py.

A variant replaces fields of the engine's KernelConfig
(ftserve_kernels/config.py: PDL on or off, GEMV launches laid over the table,
the dense linears on the GEMV or on cuBLAS) or of the Triton attention
backend's AttnKernelConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftserve_kernels.attention_common import AttnKernelConfig
from ftserve_kernels.config import KernelConfig
from tools.bench.common import markdown_table

# The KernelConfig fields a variant may set (backend is the engine's device's).
KERNEL_FIELDS = ("pdl", "gemv_entries", "dense_gemv")


@dataclass(frozen=True)
class Variant:
    """One point to measure. ``group`` is the knob it turns (options of one
    group exclude each other when the best are combined); the baseline and the
    combination have none. ``kernels`` replaces KernelConfig fields, ``attn``
    AttnKernelConfig fields."""

    name: str
    group: str = ""
    kernels: Mapping[str, Any] = field(default_factory=dict)
    attn: Mapping[str, Any] = field(default_factory=dict)

    def kernel_config(self, base: KernelConfig) -> KernelConfig:
        """``base`` (the engine's) with this variant's fields."""
        return dataclasses.replace(base, **self.kernels)


def default_variants(base_attn: AttnKernelConfig) -> list[Variant]:
    """Baseline first, then one knob at a time; ``base_attn`` is the
    AttnKernelConfig the backend uses by default on this device."""
    pps = base_attn.decode_programs_per_sm
    out = [Variant("baseline")]
    out.append(Variant("kernels pdl=0", "kernels:pdl", kernels={"pdl": False}))
    # The layers' dense linears on cuBLAS and unfused (SiLU, product, norms their
    # own launches) instead of the GEMV and its folds: the GEMV-or-cuBLAS question
    # at the model's shapes (KernelConfig.dense_gemv).
    out.append(Variant("kernels dense_gemv=0", "kernels:dense_gemv", kernels={"dense_gemv": False}))
    for factor in (0.5, 2.0):
        n = max(1, round(pps * factor))
        if n != pps:
            out.append(Variant(f"attn programs_per_sm={n}", "attn_programs_per_sm",
                               attn={"decode_programs_per_sm": n}))
    # At batch 1 the split count sits at the max_splits cap (H200: 132 SMs x 4
    # programs over 4 KV heads > 128), so only another cap changes it there.
    for n in sorted({base_attn.max_splits // 4, base_attn.max_splits // 2, base_attn.max_splits * 2}):
        if 1 <= n != base_attn.max_splits:
            out.append(Variant(f"attn max_splits={n}", "attn_max_splits", attn={"max_splits": n}))
    return out


def _fields(name: str, words: list[str], fields: dict[str, Any], base: Any, what: str) -> dict[str, Any]:
    """FIELD=VALUE words -> {field: value typed as ``base``'s (0/1 for flags)}."""
    out: dict[str, Any] = {}
    for word in words or ["?"]:
        key, sep, value = word.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"variant {name!r}: {word!r} is not FIELD=VALUE of a {what} field "
                             f"({', '.join(fields)})")
        kind = type(getattr(base, key))
        try:
            out[key] = bool(int(value)) if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"variant {name!r}: {key} takes a {kind.__name__}, not {value!r}") from None
    return out


def parse_variant(name: str, base_attn: AttnKernelConfig) -> Variant:
    """An ad-hoc variant from its name: ``attn FIELD=VALUE [FIELD=VALUE ...]``
    (AttnKernelConfig fields, ints or 0/1 for flags) or ``kernels FIELD=VALUE
    ...`` (KernelConfig's KERNEL_FIELDS, e.g. ``kernels
    gemv_entries=dense:N=2048+K=4096@1=4.512.8.3``). Its group names what it
    turns ("attn:decode_block_n", "kernels:pdl"), so ad-hoc options of one field
    exclude each other in the combination, and one that turns several ("+" in
    the group) never enters it. A KernelConfig that would not build (a bad
    GEMV entry) is a ValueError here."""
    words = name.split()
    kind = words[0] if words else ""
    if kind == "attn":
        attn = _fields(name, words[1:], {f.name: f for f in dataclasses.fields(AttnKernelConfig)}, base_attn,
                       "AttnKernelConfig")
        return Variant(name, "attn:" + "+".join(sorted(attn)), attn=attn)
    if kind == "kernels":
        kernels = _fields(name, words[1:], {f: f for f in KERNEL_FIELDS}, KernelConfig(), "KernelConfig")
        KernelConfig(**kernels)  # a bad entry fails now, not mid-run
        return Variant(name, "kernels:" + "+".join(sorted(kernels)), kernels=kernels)
    raise ValueError(f"variant {name!r} is neither a known variant nor 'attn FIELD=VALUE ...' / "
                     f"'kernels FIELD=VALUE ...'")


def select_variants(variants: Sequence[Variant], only: str, base_attn: AttnKernelConfig) -> list[Variant]:
    """The baseline, then the comma-separated names of ``only`` in their order:
    each one of ``variants`` or an ad-hoc one (parse_variant). ValueError names
    the one that is neither."""
    by_name = {v.name: v for v in variants}
    out = [by_name["baseline"]]
    for name in (n.strip() for n in only.split(",")):
        if name and name != "baseline" and name not in {v.name for v in out}:
            out.append(by_name[name] if name in by_name else parse_variant(name, base_attn))
    return out


def score_ms(row: Mapping[str, Any]) -> float | None:
    """What a variant is ranked by: the graph replay time of one batch-1 step;
    without graphs (CPU), the engine's batch-1 step time."""
    if row.get("replay_ms") is not None:
        return float(row["replay_ms"])
    tps = (row.get("decode_b1") or {}).get("tokens_per_s")
    return 1e3 / tps if tps else None


def combine_best(rows: Sequence[Mapping[str, Any]], variants: Sequence[Variant],
                 min_gain: float) -> tuple[Variant | None, dict[str, str]]:
    """The combination of each group's fastest variant that matched the
    baseline's tokens and beat the baseline's score by more than ``min_gain``
    (a fraction). Returns (variant, {group: winner}); the variant is None when
    fewer than two groups have a winner (one winner was measured already)."""
    by_name = {v.name: v for v in variants}
    base = next((r for r in rows if r["name"] == "baseline" and not r.get("error")), None)
    base_ms = score_ms(base) if base is not None else None
    if base_ms is None:
        return None, {}
    best: dict[str, tuple[float, Variant]] = {}
    for r in rows:
        v = by_name.get(r["name"])
        ms = score_ms(r)
        if (v is None or not v.group or "+" in v.group or r.get("error") or r.get("tokens_ok") is not True
                or ms is None):
            continue
        if ms < base_ms * (1.0 - min_gain) and (v.group not in best or ms < best[v.group][0]):
            best[v.group] = (ms, v)
    winners = {g: v.name for g, (_, v) in sorted(best.items())}
    if len(best) < 2:
        return None, winners
    kernels: dict[str, Any] = {}
    attn: dict[str, Any] = {}
    for _, v in best.values():
        kernels.update(v.kernels)
        attn.update(v.attn)
    return Variant("combined: " + " + ".join(winners.values()), "", kernels, attn), winners


def should_skip(now: float, deadline: float, durations: Sequence[float], reserve: int) -> bool:
    """Skip a variant unless ``reserve`` variants as slow as the slowest so far
    (this one and any kept for later) fit before the deadline."""
    if not durations:
        return False
    return deadline - now < reserve * max(durations)


def render_table(rows: Sequence[Mapping[str, Any]], batches: Sequence[int] = (1, 8),
                 skipped: Sequence[str] = ()) -> str:
    """Markdown: one line per measured variant, then the skipped ones. The
    roofline columns are batch 1's (``batches[0]``)."""
    base = next((r for r in rows if r["name"] == "baseline"), None)
    base_ms = score_ms(base) if base is not None else None
    table = []
    for r in rows:
        ms = score_ms(r)
        tok = {True: "yes", False: f"NO (step {r.get('mismatch_at')})", None: "-"}[r.get("tokens_ok")]
        if r.get("error"):
            tok = "FAILED: " + str(r["error"]).splitlines()[0][:60]
        first = r.get(f"decode_b{batches[0]}") or {}
        frac, replay_frac = first.get("frac_of_roofline"), r.get("replay_frac_of_roofline")
        table.append((r["name"], tok, r.get("replay_ms"),
                      f"{base_ms / ms:.3f}x" if base_ms and ms else None,
                      f"{100 * replay_frac:.1f}%" if replay_frac is not None else None,
                      first.get("tokens_per_s"), f"{100 * frac:.1f}%" if frac is not None else None,
                      *((r.get(f"decode_b{bs}") or {}).get("tokens_per_s") for bs in batches[1:])))
    headers = ("variant", "tokens ok", "replay ms", "speed-up", "replay % roofline",
               f"tok/s b{batches[0]}", f"% roofline b{batches[0]}",
               *(f"tok/s b{bs}" for bs in batches[1:]))
    text = markdown_table(headers, table)
    if skipped:
        text += "\n\nskipped (time budget): " + ", ".join(skipped)
    return text


def backend_for(backend: Any, base_attn: AttnKernelConfig, v: Variant) -> Any:
    """The attention backend variant ``v`` runs: the build's own unless it
    changes AttnKernelConfig fields, then a Triton backend with those."""
    if not v.attn:
        return backend
    if getattr(backend, "name", "") != "triton":
        raise RuntimeError(f"attention config variants need the triton backend; this engine "
                           f"runs {getattr(backend, 'name', type(backend).__name__)}")
    from ftserve_kernels.attention_triton import TritonAttentionBackend

    return TritonAttentionBackend(scale=backend.scale, cfg=dataclasses.replace(base_attn, **v.attn),
                                  extend_token_bound=backend.extend_token_bound)

