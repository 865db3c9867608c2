"""Constrained decoding in the engine: grammar-masked requests batched with free ones
(greedy tokens of the free ones unchanged, the constrained ones valid JSON), with and
without overlap scheduling, and the grammar's own end as finish_reason "stop"."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from ftserve.engine.engine import Engine
from ftserve.engine.grammar import GrammarMatcher
from ftserve.engine.messages import RequestOutput
from ftserve.engine.sampling_params import SamplingParams
from ftserve.tokenizer import Tokenizer, load_tokenizer
from ftserve.tokenizer.grammar_view import grammar_tokenizer
from tests.engine_util import collect, greedy, tokens_of
from tests.test_engine import make_engine, prompt

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["id", "ok", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 6}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ftserve.models.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny-moe")
    write_checkpoint("tiny-moe", out, config_only=True)
    return str(out)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    eng = make_engine(model_dir, enable_prefix_cache=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Tokenizer:
    return load_tokenizer(model_dir)


def _matcher(tok: Tokenizer, vocab: int, schema: dict[str, object]) -> GrammarMatcher:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    return GrammarMatcher.compile(grammar_tokenizer(tok, vocab), grammar)


def _run(engine: Engine, reqs: list[tuple[str, list[int], SamplingParams,
                                          GrammarMatcher | None]]) -> dict[str, list[RequestOutput]]:
    from ftserve.engine.messages import GenerateRequest

    grammars = {rid: g for rid, _, _, g in reqs}
    real = GenerateRequest
    orig_submit = engine.submit

    def submit(msg: GenerateRequest) -> None:
        orig_submit(real(msg.request_id, msg.prompt_ids, msg.params, msg.arrival_time,
                         grammars.get(msg.request_id)))

    engine.submit = submit  # type: ignore[method-assign]
    try:
        return collect(engine, [(rid, p, params) for rid, p, params, _ in reqs])
    finally:
        del engine.submit


def _check(obj: object) -> None:
    assert isinstance(obj, dict) and set(obj) == {"id", "ok", "tag"}, obj
    assert isinstance(obj["id"], int) and 0 <= obj["id"] <= 999
    assert isinstance(obj["ok"], bool)
    assert isinstance(obj["tag"], str) and len(obj["tag"]) <= 6


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_and_free_requests_in_one_batch(model_dir: str, engine: Engine,
                                                    tok: Tokenizer, overlap: bool) -> None:
    eng = engine if overlap else make_engine(model_dir, enable_prefix_cache=False,
                                             overlap_schedule=False)
    try:
        rng = random.Random(7)
        free = [(f"free{i}", prompt(rng, 9 + i), greedy(24)) for i in range(2)]
        alone = _run(eng, [(rid, p, sp, None) for rid, p, sp in free])
        vocab = eng.vocab_size
        mixed = _run(eng, [
            *[(rid, p, sp, None) for rid, p, sp in free],
            ("json_greedy", prompt(rng, 11), SamplingParams(max_tokens=120, temperature=0.0),
             _matcher(tok, vocab, SCHEMA)),
            ("json_sampled", prompt(rng, 5), SamplingParams(max_tokens=120, temperature=1.0,
                                                             seed=5),
             _matcher(tok, vocab, SCHEMA)),
        ])
        for rid, _, _ in free:
            assert tokens_of(mixed[rid]) == tokens_of(alone[rid]), rid
        for rid in ("json_greedy", "json_sampled"):
            assert mixed[rid][-1].finish_reason == "stop", rid
            _check(json.loads(tok.decode(tokens_of(mixed[rid]))))
    finally:
        if eng is not engine:
            eng.shutdown()


def test_overlap_same_constrained_tokens(model_dir: str, engine: Engine, tok: Tokenizer) -> None:
    """The mask of each step is built after the previous token is known, with overlap
    scheduling as without it."""
    rng = random.Random(3)
    p = prompt(rng, 8)
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=11)
    a = _run(engine, [("a", p, params, _matcher(tok, engine.vocab_size, SCHEMA))])
    eng = make_engine(model_dir, enable_prefix_cache=False, overlap_schedule=False)
    try:
        b = _run(eng, [("a", p, params, _matcher(tok, eng.vocab_size, SCHEMA))])
    finally:
        eng.shutdown()
    assert tokens_of(a["a"]) == tokens_of(b["a"])
    assert a["a"][-1].finish_reason == "stop"
