"""--generation-config: the checkpoint's recommended sampling (generation_config.json)
fills the fields a request leaves out; the request's own fields win; ``none`` keeps
the neutral defaults. Against a real server over a tiny checkpoint written here."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ftserve.chat.generation_defaults import sampling_defaults
from ftserve.config import ServerConfig
from ftserve.models.checkpoint import write_checkpoint
from tests.server_harness import (
    TEST_ENGINE,
    TEST_SERVER,
    Live,
    openai_client,
    start_live,
    stop_live,
)


def _with_gen_config(d: Path, extra: dict[str, Any] | str) -> str:
    path = d / "generation_config.json"
    base = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(extra if isinstance(extra, str) else json.dumps({**base, **extra}))
    return str(d)


@pytest.mark.parametrize("extra, want", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},  # Qwen3's
     {"temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    ({"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.05},
     {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.05}),
    ({"do_sample": False, "temperature": 0.6}, {}),  # transformers decodes greedily then
    ({"temperature": 5.0, "top_p": 0.9}, {"top_p": 0.9}),  # out of range: that field dropped
    ({"top_k": 2.5, "top_p": True, "temperature": "hot"}, {}),  # not numbers of the field's kind
    ({"max_new_tokens": 20, "bos_token_id": 1}, {}),  # nothing about sampling
    ("{not json", {}),
])
def test_reads_the_recommended_sampling(tmp_path: Path, extra: dict[str, Any] | str,
                                        want: dict[str, Any]) -> None:
    assert sampling_defaults(_with_gen_config(tmp_path, extra)) == want


def test_no_file_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(str(tmp_path)) == {}


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The demo shape with generation_config.json recommending top_k 1 (greedy)."""
    d = write_checkpoint("tiny-moe", tmp_path_factory.mktemp("ckpt"), config_only=True)
    model = _with_gen_config(d, {"top_k": 1})
    live = start_live(dataclasses.replace(TEST_ENGINE, model=model, load_format="dummy"))
    yield live
    stop_live(live)


def _texts(client: openai.OpenAI, seeds: tuple[int, ...], extra: dict[str, Any] | None = None,
           **kw: Any) -> list[str]:
    body = {"ignore_eos": True, **(extra or {})}
    return [client.completions.create(model="ftserve-demo", prompt="Once upon a time", max_tokens=8,
                                      seed=s, extra_body=body, **kw).choices[0].text for s in seeds]


def test_defaults_fill_only_missing_fields(greedy_by_default: Live) -> None:
    live = greedy_by_default
    client = openai_client(live)
    assert live.state.sampling_defaults == {"top_k": 1}
    greedy = _texts(client, (1,), temperature=0)[0]
    # Nothing given: top_k 1 from the checkpoint, so every seed gives the greedy text.
    assert _texts(client, (1, 2, 3)) == [greedy] * 3
    # The request's own top_k wins: sampled at temperature 1, the seeds differ.
    sampled = _texts(client, (1, 2, 3), extra={"top_k": 0})
    assert len(set(sampled)) > 1, sampled
    # --generation-config none on a second listener over the same engine: neutral.
    url = live.listen(dataclasses.replace(TEST_SERVER, generation_config="none"))
    neutral = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert _texts(neutral, (1, 2, 3)) == sampled  # as top_k 0: the same draws per seed
    live.wait_idle()


def test_flag_values() -> None:
    assert ServerConfig().generation_config == "auto"
