"""Soak checks: server health, leak detection and canary outputs (``--soak``).

Baseline (before load) -> periodic scrapes of /health and /metrics during the run -> after drain,
wait up to ``settle_s`` for the server to return to baseline. Violations are collected as
human-readable strings; any violation makes the run exit non-zero.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "ftserve_num_requests_running"
WAITING = "ftserve_num_requests_waiting"
KV_USAGE = "ftserve_kv_cache_usage_ratio"
KV_PAGES = "ftserve_kv_pages_used"
RSS = "process_resident_memory_bytes"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, summing samples that differ only by labels."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def read_rss_bytes(pid: int) -> int | None:
    """VmRSS of a local process, or None if it cannot be read (other host, exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class Snapshot:
    t: float  # seconds since the run's t0
    healthy: bool
    metrics: dict[str, float]
    rss: int | None
    error: str | None = None


@dataclass
class SoakConfig:
    scrape_interval_s: float = 1.0
    settle_s: float = 15.0
    max_rss_growth_mb: float = 512.0
    kv_usage_tolerance: float = 0.0
    max_errors: int = 0
    server_pid: int | None = None


@dataclass
class SoakMonitor:
    """Scrapes the server; ``violations`` says what went wrong."""

    base_url: str
    cfg: SoakConfig
    t0: float
    snapshots: list[Snapshot] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    baseline: Snapshot | None = None
    final: Snapshot | None = None

    async def scrape(self, session: aiohttp.ClientSession) -> Snapshot:
        t = time.perf_counter() - self.t0
        healthy, metrics, err = False, {}, None
        try:
            async with asyncio.timeout(10.0):
                async with session.get(self.base_url + "/health") as r:
                    healthy = r.status == 200
                    if not healthy:
                        err = f"/health returned HTTP {r.status}"
                async with session.get(self.base_url + "/metrics") as r:
                    if r.status != 200:
                        err = err or f"/metrics returned HTTP {r.status}"
                    else:
                        metrics = parse_metrics(await r.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            err = f"scrape failed: {type(e).__name__}: {e}"
        rss = read_rss_bytes(self.cfg.server_pid) if self.cfg.server_pid else None
        if rss is None and RSS in metrics:
            rss = int(metrics[RSS])
        snap = Snapshot(t, healthy and err is None, metrics, rss, err)
        self.snapshots.append(snap)
        return snap

    async def take_baseline(self, session: aiohttp.ClientSession) -> None:
        self.baseline = await self.scrape(session)
        b = self.baseline
        if not b.healthy:
            self.violations.append(f"server unhealthy before the run: {b.error}")
        for name in (RUNNING, KV_USAGE):
            if name not in b.metrics:
                self.violations.append(f"/metrics lacks {name}; cannot check for leaks")

    async def run_periodic(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            snap = await self.scrape(session)
            if not snap.healthy:
                self.violations.append(f"t={snap.t:.1f}s: server unhealthy during the run: {snap.error}")
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.scrape_interval_s)
            except TimeoutError:
                pass

    def _settled(self, s: Snapshot) -> list[str]:
        """What is still off baseline in snapshot ``s`` (empty when settled)."""
        assert self.baseline is not None
        b, m = self.baseline.metrics, s.metrics
        off: list[str] = []
        if not s.healthy:
            off.append(f"server unhealthy after drain: {s.error}")
        for name in (RUNNING, WAITING):
            if name in m and m[name] > b.get(name, 0.0):
                off.append(f"{name} = {m[name]:g} after drain (baseline {b.get(name, 0.0):g}): requests leaked")
        if KV_USAGE in m and m[KV_USAGE] > b.get(KV_USAGE, 0.0) + self.cfg.kv_usage_tolerance:
            off.append(
                f"{KV_USAGE} = {m[KV_USAGE]:.4f} after drain (baseline {b.get(KV_USAGE, 0.0):.4f}, "
                f"tolerance {self.cfg.kv_usage_tolerance}): KV pages leaked"
            )
        if s.rss is not None and self.baseline.rss is not None:
            growth = (s.rss - self.baseline.rss) / 2**20
            if growth > self.cfg.max_rss_growth_mb:
                off.append(
                    f"server RSS grew {growth:.0f} MiB over the run (limit --max-rss-growth-mb "
                    f"{self.cfg.max_rss_growth_mb:g})"
                )
        return off

    async def settle(self, session: aiohttp.ClientSession) -> None:
        """After drain: poll until back at baseline or ``settle_s`` passes; record what is not."""
        if self.baseline is None:
            return
        deadline = time.perf_counter() + self.cfg.settle_s
        while True:
            snap = await self.scrape(session)
            off = self._settled(snap)
            if not off or time.perf_counter() >= deadline:
                break
            await asyncio.sleep(min(0.25, self.cfg.scrape_interval_s))
        self.final = snap
        self.violations.extend(off)

    def rss_growth_mb(self) -> float | None:
        if self.baseline is None or self.final is None:
            return None
        if self.baseline.rss is None or self.final.rss is None:
            return None
        return (self.final.rss - self.baseline.rss) / 2**20

    def report(self) -> dict[str, Any]:
        def brief(s: Snapshot | None) -> dict[str, Any] | None:
            if s is None:
                return None
            keys = (RUNNING, WAITING, KV_USAGE, KV_PAGES)
            return {"t": s.t, "healthy": s.healthy, "rss": s.rss,
                    **{k: s.metrics[k] for k in keys if k in s.metrics}}

        return {
            "baseline": brief(self.baseline),
            "final": brief(self.final),
            "rss_growth_mb": self.rss_growth_mb(),
            "num_scrapes": len(self.snapshots),
            "violations": list(self.violations),
        }
