"""tools/bench/spec_trace.py on the CPU: the drafting policy each phase runs
with, the timeline analysis on a hand-built GPU trace (ops placed by their
launch call, graph vs eager time, periods, kernel tables, decode vs verify),
the step loops' budget stop, and a --smoke run end to end (tiny-dense, no
graphs: step kinds, overlap, the JSON fields, the markdown)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ftserve.engine.driver import EngineDriver
from ftserve.engine.request import Req
from ftserve.engine.sampling_params import SamplingParams
from ftserve.engine.spec.speculator import Speculator
from tools.bench import spec_trace as st
from tools.bench.common import DeviceOp, LaunchCall, start_run
from tools.bench.engine_driver import build


def _req(tokens: list[int]) -> Req:
    return Req("r", tokens, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), 0.0)


def test_each_phase_drafts_as_it_says() -> None:
    base = Speculator(4, 2, 4, 4096)
    unmatched = list(range(100, 140))  # no n-gram repeats: the engine's speculator misses
    got = {}
    for mode in ("ngram", "always", "never"):
        spec, req = st.TraceSpeculator(mode, base), _req(unmatched)
        assert spec.num_tokens == 4 and (spec.min_match, spec.max_match) == (2, 4)
        got[mode] = [spec.propose(req) for _ in range(3)], spec.drafting(req)
    # ngram: a miss, then back-off (no lookups, and no read-back wanted).
    assert got["ngram"] == ([[], [], []], False)
    # always: the request's last k tokens where nothing matches, at every step.
    assert got["always"] == ([unmatched[-4:]] * 3, True)
    # never: no draft, and still drafting: every step is read back at once.
    assert got["never"] == ([[], [], []], True)
    # Where the text repeats, "always" proposes the n-gram's continuation.
    block = list(range(200, 210))
    req = _req(block + block[:3])
    assert st.TraceSpeculator("always", base).propose(req) == block[3:7]


def _gpu_like_trace() -> st.Timeline:
    """Two overlapped decode steps (one graph each), two verify steps (a copy in,
    the graph, eager sampling after it) and the closing read-back window.
    Host windows open at 10, 30, 90, 200, 300 (us); GPU ops start later."""
    windows = [(10, 60), (30, 85), (90, 190), (200, 295), (300, 305)]
    launches = {100: LaunchCall(11, "cudaGraphLaunch"), 200: LaunchCall(31, "cudaGraphLaunch"),
                300: LaunchCall(95, "cudaMemcpyAsync"), 301: LaunchCall(97, "cudaGraphLaunch"),
                302: LaunchCall(98, "cuLaunchKernelEx"), 303: LaunchCall(99, "cuLaunchKernelEx"),
                400: LaunchCall(205, "cudaMemcpyAsync"), 401: LaunchCall(206, "cudaGraphLaunch"),
                402: LaunchCall(207, "cuLaunchKernelEx")}
    ops = [
        # step 0: its last kernels start after window 1 opened (overlap): the
        # launch call, not the start time, places them.
        DeviceOp(20, 22, "_decode_inputs_kernel", 100), DeviceOp(22, 40, "_gemv_kernel", 100),
        DeviceOp(40, 50, "_greedy_kernel", 100),
        DeviceOp(52, 54, "_decode_inputs_kernel", 200), DeviceOp(54, 70, "_gemv_kernel", 200),
        DeviceOp(70, 80, "_greedy_kernel", 200),
        DeviceOp(100, 102, "Memcpy HtoD (Pinned -> Device)", 300),
        DeviceOp(105, 130, "gemm_kernel", 301), DeviceOp(130, 160, "gemm_kernel", 301),
        DeviceOp(161, 165, "_greedy_kernel", 302), DeviceOp(166, 167, "_copy_host_kernel", 303),
        DeviceOp(210, 212, "Memcpy HtoD (Pinned -> Device)", 400),
        DeviceOp(215, 240, "gemm_kernel", 401), DeviceOp(240, 270, "gemm_kernel", 401),
        DeviceOp(271, 275, "_greedy_kernel", 402),
        DeviceOp(280, 281, "_mystery_kernel", 0),  # no launch call recorded: by its start
        # No launch call either, but launched inside a torch op of window 1 (host 33).
        DeviceOp(95, 96, "_linked_kernel", 0, linked=7),
    ]
    return st.Timeline(windows, sorted(ops), launches, True, frontend={7: 33.0})


def test_timeline_analysis_of_a_gpu_trace() -> None:
    logs = [st.StepLog(0, "decode", True, 1), st.StepLog(1, "decode", True, 1),
            st.StepLog(2, "verify", False, 1), st.StepLog(3, "verify", False, 1)]
    rows, how = st.step_rows(logs, _gpu_like_trace())
    assert how == {"correlation": 15, "linked_op": 1, "start_time": 1, "before_first_window": 0}
    r0, r1, r2, r3 = rows
    assert (r0["ops"], r0["graph_kernels"], r0["period_us"], r0["graph_us"], r0["between_us"]) == (3, 3, 32, 30, 2)
    assert r0["idle_us"] == 2 and r0["host_to_first_op_us"] == 10
    assert (r1["period_us"], r1["graph_us"], r1["between_us"], r1["idle_us"]) == (48, 28, 20, 19)
    assert r1["ops"] == 4 and r1["outside"] == [("_linked_kernel", 1, 15), ("(next step)", 0, 4)]
    # verify: the copy in, the graph, sampling after it; the next step starts at 210.
    assert (r2["period_us"], r2["graph_us"], r2["between_us"], r2["busy_us"]) == (110, 55, 55, 62)
    assert (r2["kernels"], r2["copies"], r2["graph_kernels"], r2["eager_us"]) == (4, 1, 2, 7)
    assert [n for n, _, _ in r2["outside"]] == ["Memcpy HtoD (Pinned -> Device)", "_greedy_kernel",
                                                "_copy_host_kernel", "(next step)"]
    assert r2["outside"][0] == ("Memcpy HtoD (Pinned -> Device)", 2, 0)
    assert r2["outside"][1] == ("_greedy_kernel", 4, 1) and r2["outside"][-1] == ("(next step)", 0, 43)
    # The last step has no next one: no period; its unlaunched op still counts.
    assert r3["period_us"] is None and r3["ops"] == 5
    kinds = st.by_kind(rows)
    dec, ver = kinds["decode"], kinds["verify"]
    assert dec["steps"] == 2 and dec["overlapped_share"] == 1.0 and dec["period_us"] == 40
    assert dec["kernel_table"]["_gemv_kernel"] == {"per_step": 1.0, "us_per_step": 17.0, "in_graph": True}
    assert ver["steps"] == 1 and ver["overlapped_share"] == 0.0 and ver["graph_kernels"] == 2
    assert ver["kernel_table"]["gemm_kernel"] == {"per_step": 2.0, "us_per_step": 55.0, "in_graph": True}
    assert ver["kernel_table"]["_greedy_kernel"]["in_graph"] is False
    c = st.compare(dec, ver)
    assert set(c["only_other"]) == {"gemm_kernel", "Memcpy HtoD (Pinned -> Device)", "_copy_host_kernel"}
    assert set(c["only_base"]) == {"_decode_inputs_kernel", "_gemv_kernel", "_linked_kernel"}
    assert c["only_base"]["_linked_kernel"] == {"per_step": 0.5, "us_per_step": 0.5, "in_graph": False}
    assert c["time_changed"] == {"_greedy_kernel": {"base_us": 10.0, "other_us": 4.0}}
    assert c["ratios"]["period_us"] == round(110 / 40, 3) and c["deltas"]["kernels"] == 0.5


def test_ops_without_launch_calls_fall_back_to_their_start() -> None:
    tl = _gpu_like_trace()
    tl.launches = {}
    rows, how = st.step_rows([st.StepLog(i, "decode", True, 1) for i in range(4)], tl)
    assert how == {"correlation": 0, "linked_op": 1, "start_time": len(tl.ops) - 1, "before_first_window": 0}
    # Step 0's kernels that start after window 1 opened go to step 1: why the
    # launch calls matter for overlapped steps. No graph without them either.
    assert rows[0]["ops"] == 2 and rows[1]["ops"] == 5 and rows[0]["graph_us"] is None


def test_step_loops_stop_at_their_deadline(tmp_path: Path) -> None:
    args = st.parse_args(["--smoke", "--out", str(tmp_path)])
    device, _, _, _, model_dir = start_run(args, "ftserve-test-spec-trace-")
    engine = build(args, model_dir, device, speculative="ngram", speculative_gate=False)
    try:
        drv = EngineDriver(engine)
        drv.sched.spec = st.TraceSpeculator("always", engine.scheduler.spec)
        reqs = [drv.add(st.copy_prompt(drv, 64, 16, 0), max_tokens=64)]
        assert st.warm_up(drv, reqs, 2, time.perf_counter() + 60) > 0
        past = time.perf_counter() - 1
        t = st.time_steps(drv, reqs, 10, past)
        assert t["steps"] == 0 and t["stopped_by_budget"] and t["tok_per_s"] is None
        tr = st.trace_steps(drv, 10, device, past)
        assert tr["steps"] == 0 and tr["stopped_by_budget"] and tr["by_kind"] == {}
        tr = st.trace_steps(drv, 2, device, time.perf_counter() + 60)
        assert tr["steps"] == 2 and not tr["stopped_by_budget"]
        assert [r["kind"] for r in tr["rows"]] == ["verify", "verify"]
    finally:
        engine.shutdown()


def test_smoke_run_end_to_end(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    res = st.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "spec_trace.json").read_text())
    assert saved["phases"].keys() == res["phases"].keys() == set(st.PHASES)
    assert not res.get("errors") and not res.get("skipped"), (res.get("errors"), res.get("skipped"))
    want = {"verify": ("verify", False), "decode": ("decode", True), "decode_sync": ("decode", False)}
    for phase, (kind, overlapped) in want.items():
        ph = saved["phases"][phase]
        assert ph["timed"]["steps"] == 4 and ph["timed"]["step_counts"] == {kind: 4}
        assert ph["timed"]["tokens"] >= 4 and ph["timed"]["tok_per_s"] > 0
        tr = ph["trace"]
        assert tr["steps"] == 4 and tr["ops_source"] == "cpu torch ops"
        assert {r["kind"] for r in tr["rows"]} == {kind}
        assert {r["overlapped"] for r in tr["rows"]} == {overlapped}
        k = tr["by_kind"][kind]
        assert k["steps"] >= 3 and set(st.MEDIAN_FIELDS) <= set(k)
        assert k["period_us"] > 0 and k["graph_kernels"] == 0 and k["graph_us"] is None
        assert any(n.startswith("aten::linear") for n in k["kernel_table"])
    spec = saved["phases"]["verify"]["spec"]
    assert spec["verifies"] >= 8 and spec["proposed"] == 4 * spec["verifies"]
    assert saved["phases"]["decode_sync"]["spec"]["verifies"] == 0
    assert "spec" not in saved["phases"]["decode"]
    assert set(saved["comparison"]) == {"verify_vs_decode", "sync_vs_decode"}
    assert "aten::embedding" in saved["comparison"]["verify_vs_decode"]["only_other"]  # the eager extend path
    out = capsys.readouterr().out
    assert "| phase | step kind |" in out and out.strip() in (tmp_path / "spec_trace.md").read_text()


def test_host_profile_lists_the_engine_functions_per_step(tmp_path: Path) -> None:
    """--host-profile: each phase's steps again under cProfile, the engine's own
    functions by cumulative time per step, in the JSON and the markdown."""
    res = st.main(["--smoke", "--phases", "verify", "--host-profile", "--out", str(tmp_path)])
    host = res["phases"]["verify"]["host"]
    assert host["steps"] == 4
    assert "note" not in res["phases"]["verify"], "the requests outlast the profiled steps too"
    rows = host["host_profile"]
    names = [r[0] for r in rows]
    assert any(n.startswith("ftserve/engine/driver.py:") and n.endswith("(step)") for n in names), names
    assert all(n.startswith(("ftserve/", "ftserve_kernels/")) for n in names)
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    step = next(r for r in rows if r[0].endswith("(step)") and "driver.py" in r[0])
    assert step[1] == 1.0 and step[2] >= step[3] > 0  # one call a step; cumulative >= own
    assert "host functions of the verify phase" in (tmp_path / "spec_trace.md").read_text()
    assert "host" not in st.main(["--smoke", "--phases", "verify", "--out", str(tmp_path / "b")])["phases"]["verify"]


def test_host_calls_time_the_step_path_per_call(tmp_path: Path) -> None:
    """--host-calls: each phase's timed steps again with a perf_counter around
    the step's main host calls; a verify step plans, launches, packs its verify
    graph's inputs (the smoke's verify graphs are none: eager), samples, reads
    back and commits once each; the wrappers are gone afterwards."""
    from ftserve.engine.scheduler import Scheduler

    plain = Scheduler.__dict__["schedule"]
    res = st.main(["--smoke", "--phases", "verify,decode", "--host-calls", "--out", str(tmp_path)])
    assert Scheduler.__dict__["schedule"] is plain, "the wrappers are restored"
    verify = res["phases"]["verify"]["host_calls"]
    assert verify["steps"] == 4 and "note" not in res["phases"]["verify"]
    per_step = {r[0]: r[1] for r in verify["calls"]}
    for call in ("EngineDriver.step", "Scheduler.schedule", "ModelRunner.launch", "Sampler.sample",
                 "ModelRunner.collect_verified", "Scheduler.commit_verified"):
        assert per_step.get(call) == 1.0, (call, per_step)
    assert "Scheduler.commit" not in per_step  # a plain step's commit: the decode phase's
    decode = {r[0]: r for r in res["phases"]["decode"]["host_calls"]["calls"]}
    assert decode["Scheduler.commit"][1] == 1.0 and "ModelRunner.collect_verified" not in decode
    step = decode["EngineDriver.step"]
    assert step[2] >= decode["Scheduler.schedule"][2] > 0 and step[3] >= step[2]  # median <= p90
    md = (tmp_path / "spec_trace.md").read_text()
    assert "host calls of the verify phase" in md and "| Scheduler.commit_verified |" in md


def test_a_spent_budget_skips_every_phase(tmp_path: Path) -> None:
    res = st.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "t.json")])
    assert res["skipped"] == [f"phase {p}" for p in st.PHASES] and res["phases"] == {}
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["skipped"] == res["skipped"] and saved["engine_build"]["speculative"] == "ngram"
    assert "skipped" in (tmp_path / "t.md").read_text()


def test_cuda_ops_read_correlation_ids_from_a_profile() -> None:
    """On the CPU a profile has no CUDA ops; the helpers must still run on it."""
    from torch.profiler import ProfilerActivity, profile

    from tools.bench.common import cuda_ops, cuda_spans, launch_calls

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    assert cuda_ops(prof) == [] and cuda_spans(prof) == [] and launch_calls(prof) == {}
