"""The real small model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end: ftserve's
weights and tokenizer against transformers loading the same GGUF (float32, CPU),
then the server over HTTP with the official openai client.

Real weights make text checkable ("Paris") and keep near-tied logits rare, so
batched, chunked, prefix-hit and preempted requests must give exactly the tokens
of the same request served alone, with no prefix-cache reset between them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from ftserve.tokenizer import IncrementalTokenizer, chat_template_for, load_tokenizer
from tests.real_model import SMOLLM2
from tests.server_harness import Live

LOGPROB_TOL = 1e-3
NEAR_TIE = 1e-3

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Les élèves français étudient la littérature et",
    "1, 2, 3, 5, 8, 13, 21,",
    "Water boils at 100 degrees Celsius, which is",
    "Question: What is the largest planet in our solar system?\nAnswer:",
    "import numpy as np\n\nx = np.arange(10)\nprint(",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "東京は日本の首都で、",
    "SELECT name, email FROM users WHERE",
    "Photosynthesis is the process by which plants",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "Dear Sir or Madam,\n\nI am writing to",
    "The derivative of x^2 is 2x, and the derivative of x^3 is",
    "Emoji test: 🙂🚀✨ — and a dash; then “quotes” and ‘more’.",
    "A list of fruits:\n- apple\n- banana\n-",
    "In 1492, Columbus",
    "The mitochondria is the powerhouse of the",
    "    indented    text   with   many   spaces\n\n\n",
]


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def _complete(client: openai.OpenAI, prompt: Any, **kw: Any) -> Any:
    return client.completions.create(model=SMOLLM2, prompt=prompt, **kw)


@pytest.fixture(scope="module")
def client(smollm2_live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_live.url + "/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Any:
    return load_tokenizer(smollm2_path)


def test_prompt_logprobs_match_transformers(client: openai.OpenAI, tok: Any,
                                            smollm2_hf: tuple[Any, Any]) -> None:
    hf, _ = smollm2_hf
    worst = 0.0
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False)
        r = _complete(client, ids, echo=True, logprobs=1, max_tokens=0)
        got = r.choices[0].logprobs.token_logprobs
        assert got[0] is None and len(got) == len(ids)
        ref = torch.log_softmax(_hf_logits(hf, ids)[:-1], -1)  # position i predicts ids[i + 1]
        want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        diff = (torch.tensor(got[1:]) - want).abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGPROB_TOL, (text, diff)
    print(f"largest prompt logprob difference vs transformers: {worst:.2e}")


def test_greedy_64_tokens_match_transformers(client: openai.OpenAI, tok: Any,
                                             smollm2_hf: tuple[Any, Any]) -> None:
    """Six requests at once (batched decode); each generated token must be the
    argmax of transformers' logits after the same prefix. A different token is
    accepted only where transformers' two best logits are within NEAR_TIE, and the
    comparison ends there (the continuations differ from then on)."""
    hf, _ = smollm2_hf
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:6]]

    def run(ids: list[int]) -> list[int]:
        r = _complete(client, ids, max_tokens=64, temperature=0,
                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(run, prompts))
    for ids, out in zip(prompts, outs):
        assert len(out) == 64
        logits = _hf_logits(hf, ids + out)[len(ids) - 1:-1]  # [64, vocab]: what chose out[i]
        for i, t in enumerate(out):
            best = int(logits[i].argmax())
            if best != t:
                top2 = logits[i].topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap < NEAR_TIE and float(logits[i, t]) >= float(top2[1]), (
                    f"token {i} of {tok.decode(ids)!r}: ftserve {t}, transformers {best} "
                    f"(top-2 gap {gap:.2e})")
                print(f"accepted a near-tie divergence at token {i} (top-2 gap {gap:.2e})")
                break


CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour, ça va ?"}],
    [{"role": "user", "content": "Translate: 猫が好きです"}],
    [{"role": "user", "content": "emoji 🚀🙂 and accents: naïve café"}],
    [{"role": "user", "content": "```python\ndef add(a, b):\n    return a + b\n```\nExplain."}],
    [{"role": "user", "content": "  leading and trailing spaces  "}],
    [{"role": "user", "content": "line one\nline two\n\n\nline five"}],
    [{"role": "user", "content": "tabs\tand\ttabs"}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
     {"role": "assistant", "content": "A2"}, {"role": "user", "content": "U3"}],
    [{"role": "user", "content": "JSON: {\"a\": [1, 2, {\"b\": null}]}"}],
    [{"role": "user", "content": "Numbers 1234567890 and 3.14159 and -42"}],
    [{"role": "user", "content": "Ελληνικά, русский, עברית, العربية"}],
    [{"role": "user", "content": "I'm sure they'll say we've done it"}],
    [{"role": "user", "content": "<div class=\"x\">HTML &amp; entities</div>"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
     {"role": "user", "content": "Who are you?"}],
    [{"role": "user", "content": "SELECT * FROM t WHERE x > 10;  -- comment"}],
]


def test_chat_template_matches_apply_chat_template(tok: Any, smollm2_hf: tuple[Any, Any]) -> None:
    _, hf_tok = smollm2_hf
    template = chat_template_for(tok)
    for msgs in CONVERSATIONS:
        gen = msgs[-1]["role"] == "user"
        prompt = template.render(msgs, add_generation_prompt=gen)
        want = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True,
                                          return_dict=False)
        assert tok.encode(prompt, add_special_tokens=False) == list(want), msgs
        assert tok.decode(list(want), skip_special_tokens=False) == prompt


def test_incremental_tokenization_over_a_15_turn_chat(tok: Any) -> None:
    """Each turn resends the whole conversation; the cache tokenizes the new part
    and must give exactly the ids of a full tokenization."""
    template = chat_template_for(tok)
    cache = IncrementalTokenizer(tok, min_reuse_chars=32)
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a careful assistant."}]
    replies = ["Sure — here's the plan:\n1. read\n2. write", "Ça marche ! 🙂", "```py\nx = 1\n```",
               "The answer is 42.", "  spaced  out  ", "東京です。", "ok"]
    for turn in range(15):
        msgs.append({"role": "user", "content": f"Turn {turn}: tell me more about item #{turn * 7}."})
        prompt = template.render(msgs, add_generation_prompt=True)
        assert cache.encode(prompt) == tok.encode(prompt, add_special_tokens=False), turn
        msgs.append({"role": "assistant", "content": replies[turn % len(replies)]})
    assert cache.stats.prefix_hits >= 13 and cache.stats.fallbacks == 0, cache.stats


def test_capital_of_france(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_stream_equals_whole_with_multibyte_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=SMOLLM2, max_tokens=24, temperature=0,
                              prompt="Quelques mots français avec des accents : été, où, déjà, ")
    whole = client.completions.create(**kw).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
    assert "".join(pieces) == whole
    assert any(ord(c) > 127 for c in whole), whole  # the reply itself holds multi-byte characters
    msgs = [{"role": "user", "content": "Write three French words with accents."}]
    chat = client.chat.completions.create(model=SMOLLM2, messages=msgs, max_tokens=24, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=SMOLLM2, messages=msgs, max_tokens=24, temperature=0, stream=True))
    assert streamed == chat.choices[0].message.content


def test_json_schema_reply_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=SMOLLM2, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    reply = json.loads(r.choices[0].message.content)
    jsonschema.validate(reply, schema)


def _long_prompts(tok: Any) -> list[list[int]]:
    """Four prompts of 170-210 tokens (3-4 prefill chunks of 64), the last sharing all
    but its end with the first. With their replies they need more pages than the
    pool has (REAL_ENGINE), so running all four at once preempts."""
    story = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "and listening to the waves break against the rocks below. ")
    market = ("At the market, the baker sold warm bread, the fishmonger shouted his prices, and "
              "children ran between the stalls chasing a stray dog. ")
    recipe = "Then bake it at 220 degrees until golden, and let it cool on a rack. "
    base = [story * 7 + "Then, one night,",
            market * 7 + "Suddenly, the",
            "Recipe notes: mix the flour, water and salt; knead; rest. " + recipe * 10,
            story * 7 + "Then, one morning,"]
    return [tok.encode(p, add_special_tokens=False) for p in base]


def test_batched_chunked_prefix_hit_and_preempted_equal_single(
        smollm2_live: Live, client: openai.OpenAI, tok: Any) -> None:
    prompts = _long_prompts(tok)
    greedy = dict(max_tokens=40, temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})

    def run(ids: list[int]) -> tuple[list[int], int]:
        r = _complete(client, ids, **greedy)
        return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens

    alone = [run(ids)[0] for ids in prompts]  # one at a time (the 4th hits the 1st's prefix)
    before = smollm2_live.engine.stats().preemptions_total
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert smollm2_live.engine.stats().preemptions_total > before  # the pool is too small for all
    assert [t for t, _ in together] == alone
    # Once more, the prompts' pages in the prefix cache where they survived eviction.
    again = run(prompts[1])
    assert again[0] == alone[1] and again[1] > 0
    smollm2_live.wait_idle()


def test_ready_banner_names_the_real_model(smollm2_live: Live) -> None:
    from ftserve.api.serve import banner

    text = banner(smollm2_live.state, "127.0.0.1", smollm2_live.server.port)
    assert f"serving '{SMOLLM2}'" in text
    assert "model: SmolLM2-135M-Instruct" in text and "package index" in text
    assert "RANDOM DEMO WEIGHTS" not in text
