"""The speculation gate (ftserve/engine/spec/gate.py): speculation stays on where
it yields more tokens per second than plain decoding and goes off where it
yields fewer, per batch size bucket, from measured windows.

The policy is driven by a step clock: each step advances virtual time by what
the step would cost on a device (a verify step ``verify_cost`` plain steps),
since the CPU's own timing says nothing about a GPU's. In the engine tests the
engine runs (scheduler, n-gram drafts, verify steps, commits, overlap) and only
its gate reads that clock; its model is a next-token cycle, so that drafts are
kept at a known rate; outputs must stay plain decoding's either way."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from ftserve.api.metrics import Metrics
from ftserve.engine.engine import Engine
from ftserve.engine.spec.gate import MAX_PROBE, MIN_PROBE, WINDOW, SpecGate, bucket, bucket_name
from tests.engine_util import collect, greedy, tokens_of
from tests.test_spec_engine import make, model_dir  # noqa: F401 - the fixture


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(gate: SpecGate, clock: Clock, steps: int, rows: int, on: tuple[float, int],
          off: tuple[float, int]) -> int:
    """Run ``steps`` decode steps of ``rows`` requests: a step the gate lets
    draft costs on[0] and commits on[1] tokens, else off[0] / off[1]. Returns
    how many steps drafted."""
    drafted = 0
    for _ in range(steps):
        ok = gate.planned(rows)
        drafted += ok
        cost, tokens = on if ok else off
        clock.t += cost
        gate.observe(rows, True, tokens, ok)
    return drafted


def test_buckets() -> None:
    """Half octaves around the powers of two: a closed loop of 8 or 16 clients
    (one fewer running while a new request prefills) stays in one bucket."""
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 19, 20)] == \
        [1, 3, 4, 5, 6, 6, 7, 7, 7, 8, 9, 9, 9, 10]
    assert [bucket_name(b) for b in (1, 3, 7, 9, 2)] == ["1", "2", "7-9", "14-19", "none"]
    assert all(bucket(n) <= bucket(n + 1) for n in range(1, 600))


def test_a_slower_speculation_goes_off_and_costs_little() -> None:
    """A verify step of 3 plain steps' time that commits 2 tokens: half plain
    decoding's tokens/s. One window on, one probe off, then off, probing on
    again ever more rarely (8, 16, 32, then every 64 windows): over 400
    windows (13 s of 1 ms steps) the loss against plain decoding is under 3%."""
    clock = Clock()
    gate = SpecGate(clock)
    steps = 400 * WINDOW
    drafted = drive(gate, clock, steps, 1, on=(3.0, 2), off=(1.0, 1))
    assert not gate.allows(1)
    st = gate.buckets[1]
    assert st.rate[True] == pytest.approx(2 / 3) and st.rate[False] == pytest.approx(1.0)
    assert st.probe_every == MAX_PROBE
    # the first window and the probes after 8, 16, 32 and then every 64 windows
    assert drafted <= 10 * WINDOW
    assert gate.counters.off_steps_total == steps - drafted and gate.counters.switches_total == 1
    # tokens/s against plain decoding throughout: within 3%
    tokens = drafted * 2 + (steps - drafted)
    elapsed = drafted * 3.0 + (steps - drafted)
    assert tokens / elapsed >= 0.97 * 1.0


def test_a_faster_speculation_stays_on() -> None:
    """Verify steps that commit 4 tokens for 1.5 plain steps' time: on, with
    only the probe windows plain."""
    clock = Clock()
    gate = SpecGate(clock)
    steps = 100 * WINDOW
    drafted = drive(gate, clock, steps, 1, on=(1.5, 4), off=(1.0, 1))
    assert gate.allows(1) and gate.counters.switches_total == 0
    assert steps - drafted <= 5 * WINDOW


def test_equal_rates_keep_the_incumbent() -> None:
    """Nothing to copy (every request in back-off): both modes decode plainly;
    within HYSTERESIS the gate keeps speculation on and probes ever more rarely."""
    clock = Clock()
    gate = SpecGate(clock)
    drive(gate, clock, 40 * WINDOW, 1, on=(1.0, 1), off=(1.01, 1))
    st = gate.buckets[1]
    assert gate.allows(1) and st.probe_every > MIN_PROBE and gate.counters.switches_total == 0


def test_batch_sizes_decide_apart() -> None:
    """Speculation wins at batch 1 and loses at 16 (compute-bound verifies):
    on at one, off at the other and its neighbours in the bucket."""
    clock = Clock()
    gate = SpecGate(clock)
    for _ in range(20):
        drive(gate, clock, 3 * WINDOW, 1, on=(1.2, 4), off=(1.0, 1))
        drive(gate, clock, 3 * WINDOW, 16, on=(4.0, 40), off=(1.0, 16))
    assert gate.allows(1) and gate.allows(2) and not gate.allows(15) and not gate.allows(19)
    assert gate.allows(20) and gate.allows(13)  # not measured: on


def test_prefill_steps_idle_and_the_other_mode_break_windows() -> None:
    """A prefill step in a window drops its partial count (the window restarts),
    as do an idle engine and a step planned in the other mode (one in flight
    at a switch): a window holds steps of one mode only."""
    clock = Clock()
    gate = SpecGate(clock)
    drive(gate, clock, WINDOW - 1, 1, on=(1.0, 1), off=(1.0, 1))
    clock.t += 1000.0  # a long prefill chunk
    gate.observe(1, False, 0, False)
    assert 1 not in gate.buckets  # no window finished
    drive(gate, clock, WINDOW - 1, 1, on=(1.0, 1), off=(1.0, 1))
    gate.idle()
    clock.t += 1000.0
    drive(gate, clock, 1, 1, on=(1.0, 1), off=(1.0, 1))  # restarts the window
    assert 1 not in gate.buckets
    drive(gate, clock, WINDOW, 1, on=(1.0, 2), off=(1.0, 1))
    st = gate.buckets[1]
    assert st.rate[True] == pytest.approx(2.0) and st.probing  # the first window, then a probe
    clock.t += 1000.0  # a slow step planned before the probe, committed in it
    gate.observe(1, True, 2, True)
    drive(gate, clock, WINDOW + 1, 1, on=(1.0, 2), off=(1.0, 1))
    assert st.rate[False] == pytest.approx(1.0)  # it did not count


# ----- in the engine ------------------------------------------------------------


def step_clock(eng: Engine, verify_cost: float) -> Clock:
    """The engine's gate reads virtual time that each launched step advances:
    a verify step by verify_cost, any other by 1."""
    clock = Clock()
    launch = eng.runner.launch

    def timed(batch: Any) -> Any:
        clock.t += verify_cost if batch.verifies else 1.0
        return launch(batch)

    eng.runner.launch = timed  # type: ignore[method-assign]
    spec = eng.scheduler.spec
    assert spec is not None and spec.gate is not None
    spec.gate.clock = clock
    return clock


def copying_engine(model_dir: str, **kw: Any) -> Engine:  # noqa: F811
    """An engine whose model continues every token t with next(t), a cycle of
    PERIOD tokens (tools/bench/host_verify.py): once a cycle has gone by, each
    n-gram draft is kept whole, so what speculation gains is known and only the
    gate's decision is in question."""
    from tools.bench.host_verify import NextTokenModel

    eng = make(model_dir, **kw)
    eng.runner.model = NextTokenModel(eng.runner.sampler.vocab_size)
    return eng


@pytest.mark.parametrize("verify_cost,on", [(12.0, False), (1.5, True)])
def test_engine_gate_follows_the_step_costs(model_dir: str, verify_cost: float, on: bool) -> None:  # noqa: F811
    """One request decoding 600 tokens, every draft of 4 kept. Verify steps that
    cost 12 plain steps lose (5 tokens each): the gate turns speculation off
    after its first window and probe, and most steps are plain; at 1.5 plain
    steps they win and speculation stays on. The tokens are plain decoding's
    either way; /metrics reports the gated steps and both measured rates."""
    plain = copying_engine(model_dir)
    eng = copying_engine(model_dir, speculative="ngram", num_speculative_tokens=4, speculative_gate=True)
    try:
        prompt = [300, 301, 302]
        want = tokens_of(collect(plain, [("r", prompt, greedy(600))])["r"])
        step_clock(eng, verify_cost)
        got = tokens_of(collect(eng, [("r", prompt, greedy(600))])["r"])
        assert got == want
        gate = eng.scheduler.spec.gate  # type: ignore[union-attr]
        assert gate is not None and gate.allows(1) is on and gate.counters.switches_total == (not on)
        st = eng.stats()
        assert st.spec_verifies_total > 0 and st.spec_accepted_tokens_total > 0
        rates = dict((name, (r_on, r_off)) for name, r_on, r_off in st.spec_gate_rates)
        r_on, r_off = rates["1"]
        assert r_off == pytest.approx(1.0, rel=0.05)
        assert r_on == pytest.approx(5 / verify_cost, rel=0.1)
        if on:
            assert st.spec_gated_steps_total <= WINDOW + 2  # the first probe
        else:
            assert st.spec_gated_steps_total > 2 * st.spec_verifies_total
        text = generate_latest(Metrics(lambda: st).registry).decode()
        assert f"ftserve_spec_gated_steps_total {float(st.spec_gated_steps_total)}" in text
        assert 'ftserve_spec_gate_tokens_per_second{batch="1",speculation="off"}' in text
    finally:
        plain.shutdown()
        eng.shutdown()


def test_gate_flag(model_dir: str) -> None:  # noqa: F811
    """The gate is on by default; --disable-speculative-gate: none, every step may draft."""
    from ftserve.cli import build_parser, configs_from_args

    for flags, want in (([], True), (["--disable-speculative-gate"], False)):
        cfg, _ = configs_from_args(build_parser().parse_args(["serve", *flags]))
        assert cfg.speculative_gate is want
        eng = make(model_dir, speculative="ngram", speculative_gate=cfg.speculative_gate)
        try:
            assert eng.scheduler.spec is not None and (eng.scheduler.spec.gate is not None) is want
        finally:
            eng.shutdown()
