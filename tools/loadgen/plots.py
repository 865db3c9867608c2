"""PNG plots for --out (matplotlib is the optional ``loadgen`` extra)."""

from __future__ import annotations

import os
import warnings

import numpy as np

from tools.loadgen.client import RequestRecord
from tools.loadgen.soak import KV_USAGE, RUNNING, WAITING, Snapshot


def write_plots(out_dir: str, records: list[RequestRecord], snapshots: list[Snapshot]) -> list[str]:
    """Write the plots; returns the file names written (empty, with a warning, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(
            "matplotlib is not installed: plots skipped (pip install 'ftserve[loadgen]')",
            stacklevel=2,
        )
        return []
    written: list[str] = []

    def save(fig: object, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written.append(name)

    timed = [r for r in records if r.phase == "measure" and r.ttft is not None]
    if timed:
        prompt = np.array([r.prompt_tokens or 0 for r in timed])
        cached = np.array([r.cached_tokens or 0 for r in timed])
        ttft = np.array([r.ttft for r in timed]) * 1000.0
        has_usage = np.array([r.prompt_tokens is not None for r in timed])  # aborted: no usage
        for name, x, xlabel in (("ttft_vs_prompt_tokens.png", prompt, "prompt tokens"),
                                ("ttft_vs_cached_tokens.png", cached, "cached prompt tokens")):
            x, y, c = x[has_usage], ttft[has_usage], (prompt - cached)[has_usage]
            if x.size == 0:
                continue
            fig, ax = plt.subplots(figsize=(7, 4.5))
            sc = ax.scatter(x, y, c=c, s=10, cmap="viridis")
            fig.colorbar(sc, ax=ax, label="uncached prompt tokens")
            # A median line per context bin answers "does TTFT stay flat as context grows?"
            edges = np.unique(np.quantile(x, np.linspace(0.0, 1.0, 11)))
            if edges.size > 2:
                idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, edges.size - 2)
                mids = [(edges[i] + edges[i + 1]) / 2 for i in range(edges.size - 1) if (idx == i).any()]
                meds = [np.median(y[idx == i]) for i in range(edges.size - 1) if (idx == i).any()]
                ax.plot(mids, meds, color="red", label="median per bin")
                ax.legend()
            ax.set_xlabel(xlabel)
            ax.set_ylabel("TTFT (ms)")
            ax.set_title(f"TTFT vs {xlabel}")
            ax.grid(alpha=0.3)
            save(fig, name)

        itl_t = np.array([t for r in timed for t in r.chunk_times[1:]])
        itl_v = np.array([x for r in timed for x in r.itl[: max(0, len(r.chunk_times) - 1)]]) * 1000.0
        if itl_t.size and itl_t.size == itl_v.size:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            ax.scatter(itl_t, itl_v, s=2, alpha=0.4)
            ax.set_xlabel("time since start (s)")
            ax.set_ylabel("inter-token latency (ms)")
            ax.set_title("ITL over time")
            ax.grid(alpha=0.3)
            save(fig, "itl_over_time.png")

        chunks = np.array([t for r in records for t in r.chunk_times])
        if chunks.size:
            bins = np.arange(0.0, float(chunks.max()) + 1.0, 1.0)
            hist, edges = np.histogram(chunks, bins=bins)
            fig, ax = plt.subplots(figsize=(7, 4.5))
            ax.plot(edges[:-1], hist)
            ax.set_xlabel("time since start (s)")
            ax.set_ylabel("output chunks / s (~tokens / s)")
            ax.set_title("Output throughput over time")
            ax.grid(alpha=0.3)
            save(fig, "throughput_over_time.png")

    served = [r for r in records if r.phase == "measure" and r.replica and r.session >= 0]
    if served:
        # One row per session, a dot per request coloured by the replica that served it:
        # a router with session affinity draws each row in one colour.
        names = sorted({r.replica for r in served if r.replica})
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.3 * len({r.session for r in served})))
        for i, name in enumerate(names):
            mine = [r for r in served if r.replica == name]
            ax.scatter([r.start for r in mine], [r.session for r in mine], s=14,
                       color=plt.get_cmap("tab10")(i % 10), label=name)
        ax.set_xlabel("request start (s since start)")
        ax.set_ylabel("session")
        ax.set_title("Which replica served each request")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(alpha=0.3)
        save(fig, "replica_per_session.png")

    if snapshots:
        t = [s.t for s in snapshots]
        fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
        axes[0].plot(t, [s.metrics.get(RUNNING, np.nan) for s in snapshots], label="running")
        axes[0].plot(t, [s.metrics.get(WAITING, np.nan) for s in snapshots], label="waiting")
        axes[0].legend()
        axes[1].plot(t, [s.metrics.get(KV_USAGE, np.nan) for s in snapshots])
        axes[1].set_ylabel("KV usage")
        axes[2].plot(t, [(s.rss or np.nan) / 2**20 for s in snapshots])
        axes[2].set_ylabel("server RSS (MiB)")
        axes[2].set_xlabel("time since start (s)")
        for ax in axes:
            ax.grid(alpha=0.3)
        save(fig, "server_metrics.png")
    return written
