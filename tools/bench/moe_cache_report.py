"""The report of a tools/bench/moe_cache.py run: the summary (each offload
row against its PCIe bound and the resident rows) and its markdown tables."""

from __future__ import annotations

from typing import Any

from tools.bench.common import markdown_table


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    gbps = (results.get("limits") or {}).get("h2d", {}).get("h2d_gbps")
    # Decode copies are SM loads over UVA (device-chosen rows inside the graph), which
    # peak below cudaMemcpy: the fraction at that rate says how much is the kernel path.
    uva = (results.get("limits") or {}).get("uva_fill", {}).get("gbps")
    res = {r["prefix"]: r for r in results.get("resident_prefill") or [] if "prefix" in r}
    out: dict[str, Any] = {"h2d_gbps": gbps, "uva_gbps": uva, "prefill": [], "decode": []}
    for mode in ("offload", "offload_full"):
        for r in results.get(f"{mode}_prefill") or []:
            if "prefix" not in r:
                continue
            row: dict[str, Any] = {"mode": mode, "prefix": r["prefix"], "wall_s": r["wall_s"],
                                   "experts_streamed": r.get("experts_streamed"),
                                   "experts_uncached": r.get("experts_uncached")}
            if gbps and r.get("bytes_needed") is not None:
                row["pcie_bound_s"] = r["bytes_needed"] / (gbps * 1e9)
            if r["prefix"] in res:
                row["resident_s"] = res[r["prefix"]]["wall_s"]
            floor = max(row.get("pcie_bound_s") or 0.0, row.get("resident_s") or 0.0)
            if floor > 0:
                row["ratio_to_bound"] = r["wall_s"] / floor
                row["ok"] = row["ratio_to_bound"] <= 1.1
            out["prefill"].append(row)
        res_dec = {r["batch"]: r for r in results.get("resident_decode") or []}
        for r in results.get(f"{mode}_decode") or []:
            prof = r.get("profile") or {}
            row = {"mode": mode, "batch": r["batch"], "tokens_per_s": r["tokens_per_s"],
                   "fill_ms_per_step": prof.get("fill_ms_per_step"),
                   "fill_overlapped_frac": prof.get("fill_overlapped_frac"),
                   "hit_rate": r.get("hit_rate"), "copies_per_step": r.get("experts_missed_per_step"),
                   "resident_tokens_per_s": res_dec.get(r["batch"], {}).get("tokens_per_s")}
            missed = r.get("missed_bytes_per_step")
            if gbps and missed:
                row["pcie_bound_tokens_per_s"] = r["batch"] / (missed / (gbps * 1e9))
                row["frac_of_pcie_bound"] = r["tokens_per_s"] / row["pcie_bound_tokens_per_s"]
                if uva:
                    row["frac_of_uva_bound"] = r["tokens_per_s"] * missed / (uva * 1e9) / r["batch"]
                row["ok"] = row["frac_of_pcie_bound"] >= 0.9
                # A layer's misses are known only after its router and the next
                # layer needs their output: only the expert compute can run beside
                # the copies. The rest of a resident step (attention, norms,
                # router, lm_head, sampling, host) adds to the copy time, so the most
                # this row can reach is bound / (bound + that serial time).
                res_row = res_dec.get(r["batch"])
                if res_row and res_row.get("expert_ms_per_step") is not None:
                    serial_s = (res_row["step_ms"] - res_row["expert_ms_per_step"]) / 1e3
                    bound_s = missed / (gbps * 1e9)
                    row["serial_ms_per_step"] = serial_s * 1e3
                    row["ceiling_frac_of_pcie_bound"] = bound_s / (bound_s + serial_s)
                    row["frac_of_ceiling"] = row["frac_of_pcie_bound"] / row["ceiling_frac_of_pcie_bound"]
            out["decode"].append(row)
    return out


def render(summary: dict[str, Any]) -> str:
    pre = markdown_table(
        ["mode", "cached", "s / chunk", "experts uncached", "experts streamed", "PCIe bound s", "resident s",
         "ratio", "ok"],
        [[r["mode"], r["prefix"], r["wall_s"], r.get("experts_uncached"), r.get("experts_streamed"),
          r.get("pcie_bound_s"), r.get("resident_s"), r.get("ratio_to_bound"), r.get("ok")]
         for r in summary["prefill"]])
    dec = markdown_table(
        ["mode", "batch", "tok/s", "hit rate", "experts copied / step", "PCIe bound tok/s", "frac",
         "frac at UVA rate", "ceiling", "of ceiling", "resident tok/s", "fill ms / step",
         "fill overlapped", "ok"],
        [[r["mode"], r["batch"], r["tokens_per_s"], r.get("hit_rate"), r.get("copies_per_step"),
          r.get("pcie_bound_tokens_per_s"), r.get("frac_of_pcie_bound"), r.get("frac_of_uva_bound"),
          r.get("ceiling_frac_of_pcie_bound"), r.get("frac_of_ceiling"),
          r.get("resident_tokens_per_s"), r.get("fill_ms_per_step"), r.get("fill_overlapped_frac"),
          r.get("ok")] for r in summary["decode"]])
    return (f"pinned H2D: {summary['h2d_gbps']} GB/s, UVA fill kernel: {summary.get('uva_gbps')} GB/s"
            f"\n\n{pre}\n\n{dec}\n")
