"""ftserve's engine and transformers ``generate`` side by side in one process, on
one checkpoint: the two contenders tools/bench/cpu.py and tools/bench/gpu.py time
(issue 31 point 4).

Each side answers the same two questions:

    ttft(prompt)         seconds from a prompt to its first token on the host
    decode(prompts, n)   greedy decoding of a batch, n + 1 tokens a row, with a
                         stamp each time every row holds one more token

ftserve is its scheduler + runner stepped on this thread as the engine thread
steps them (ftserve/engine/driver.py), built from an ``EngineConfig`` with the
server's defaults (CUDA graphs, overlap scheduling, prefix cache), so what is
timed is the production path. transformers is ``generate`` with a streamer,
whose per-token read of the sampled ids to the host is the stamp (ftserve's is
its one deliberate read-back per step), and ``min_new_tokens`` so that an eos
stops no row early; a batch is left-padded.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftserve.config import EngineConfig
from ftserve.engine.driver import EngineDriver
from ftserve.engine.engine import Engine
from tools.bench.common import say

PRESET = "smollm2-135m"


@contextmanager
def checkpoint(model: str | None, dtype: str) -> Iterator[str]:
    """``model``, or the PRESET with random weights stored in ``dtype``, written
    to a temporary folder (tools/make_model's writer) for the duration."""
    if model is not None:
        yield model
        return
    from ftserve.models.checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-side-by-side-") as tmp:
        say(f"writing the {PRESET} preset (random {dtype} weights)")
        yield str(write_checkpoint(PRESET, Path(tmp) / PRESET, dtype=dtype))


@dataclass
class Decoded:
    stamps: list[float]  # time.perf_counter() when every row held 1, 2, ..., n + 1 tokens
    tokens: list[list[int]]  # [rows][n + 1]

    @property
    def step_s(self) -> list[float]:
        """The n step times after the first token."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    @property
    def tokens_per_s(self) -> float:
        """Tokens of all rows after their first, over the time they took."""
        return len(self.tokens) * (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


def leading_agreement(a: list[int], b: list[int]) -> int:
    """Leading tokens in common (greedy: after the first difference they diverge)."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


# ----------------------------------------------------------------- ftserve


class FtserveSide:
    name = "ftserve"

    def __init__(self, model_dir: str, dtype: str, device: str, max_len: int, kv_tokens: int,
                 max_batch: int = 1, overlap: bool = True) -> None:
        """``overlap``: step as the engine thread does (plan and launch step N + 1,
        then read back step N); off, each step is launched and read back with
        nothing in flight (on the CPU the forward runs inside the launch, so
        overlapping buys nothing and the per-step times stay whole)."""
        from ftserve.engine.setup import build_engine

        # The server's defaults except what a benchmark must pin: the KV pool (the
        # default takes 90% of the GPU, transformers shares it here), the status log.
        cfg = EngineConfig(
            model=model_dir, load_format="safetensors", dtype=dtype, device=device,
            kv_cache_tokens=kv_tokens, max_model_len=max_len, status_log_interval=0.0,
            max_running_requests=max(EngineConfig.max_running_requests, max_batch),
            cuda_graph_max_bs=max(EngineConfig.cuda_graph_max_bs, max_batch),
        )
        self.engine: Engine = build_engine(cfg)
        self.driver = EngineDriver(self.engine)
        self.overlap = overlap

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """(seconds to the first token, that token)."""
        t0 = time.perf_counter()
        req = self.driver.add(prompt, max_tokens=1)
        self.driver.run_all()
        return time.perf_counter() - t0, req.output_ids[0]

    def decode(self, prompts: list[list[int]], n: int) -> Decoded:
        drv = self.driver
        step = drv.step if self.overlap else drv.sync_step
        reqs = [drv.add(p, max_tokens=n + 1) for p in prompts]
        stamps: list[float] = []
        while len(stamps) < n + 1:
            step()
            held = min(len(r.output_ids) for r in reqs)
            if held > len(stamps):
                # One step adds one token a row: held grows by at most one a step.
                stamps.append(time.perf_counter())
        drv.run_all()
        return Decoded(stamps, [list(r.output_ids) for r in reqs])

    def close(self) -> None:
        self.driver.abort_all()
        self.engine.shutdown()


# ----------------------------------------------------------------- transformers


class _Clock:
    """A generate streamer that stamps each put: the prompt, then every new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersSide:
    name = "transformers"
    PAD = 0  # left padding of a ragged batch (masked out)

    def __init__(self, model_dir: str, dtype: str, device: str) -> None:
        import transformers

        self.version = transformers.__version__
        self.device = torch.device(device)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        # Cast again: a transformers older than the ``dtype`` keyword loads fp32.
        self.model = model.to(device=self.device, dtype=getattr(torch, dtype)).eval()

    def _generate(self, prompts: list[list[int]], n: int, streamer: Any = None) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.PAD] * (width - len(p)) + p for p in prompts], dtype=torch.int64)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64)
        out = self.model.generate(
            ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=n,
            min_new_tokens=n, do_sample=False, num_beams=1, streamer=streamer,
            pad_token_id=self.PAD, temperature=None, top_p=None, top_k=None)
        return out[:, width:].tolist()

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = self._generate([prompt], 1)
        return time.perf_counter() - t0, out[0][0]

    def decode(self, prompts: list[list[int]], n: int) -> Decoded:
        clock = _Clock()
        out = self._generate(prompts, n + 1, clock)
        stamps = clock.stamps[1:]  # [0]: the prompt
        assert len(stamps) == n + 1, len(stamps)
        return Decoded(stamps, out)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
