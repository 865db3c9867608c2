"""Runs one scheduled batch on the device: metadata upload, forward, sample,
token read-back.

Host -> device: the scheduler's plan is packed into ONE int64 host buffer
(pinned on CUDA) and sent with one non-blocking copy; the device views it.
Per-request page tables live on the device, one row per request slot, and are
updated with only the pages added since the last step:

    page_table [max_running + 1, max_pages] int32
    row s      = pages of the request in slot s (padded with dummy page 0)
    last row   = all dummy: padded batch rows (CUDA-graph padding) read it

Device -> host: the sampled tokens, read once per step that samples. That is
the step's one deliberate sync; a non-final prefill chunk reads nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ftserve.engine.messages import TokenLogprob
from ftserve.engine.scheduler import ScheduledBatch
from ftserve.kvcache.pool import KVPool
from ftserve.models.forward_batch import AttentionBackend, AttentionMetadata, ForwardBatch

if TYPE_CHECKING:
    from ftserve.engine.cuda_graph import DecodeGraphs
    from ftserve.engine.request import Req
    from ftserve.engine.sampler import SampleOutput, Sampler


@contextlib.contextmanager
def deliberate_sync() -> Iterator[None]:
    """Marks the one read-back a step may make; tests run everything else
    under torch.cuda.set_sync_debug_mode("error")."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        *,
        max_running: int,
        max_model_len: int,
        eos_token_ids: list[int],
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.page_size = kv_pool.page_size
        self.max_pages = -(-max_model_len // self.page_size)
        self.sink_row = max_running
        self.page_table = torch.zeros(  # [max_running + 1, max_pages]
            max_running + 1, self.max_pages, dtype=torch.int32, device=device)
        # Which request owns each slot's rows (page table, sampler) and how many
        # of its pages the device row already holds.
        self._owner: list[Req | None] = [None] * max_running
        self._synced: list[int] = [0] * max_running
        self._pin = device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.read_backs = 0  # deliberate device->host reads so far (tests count them)

    # ----- host -> device ------------------------------------------------
    def _upload(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self._pin)
        return host.to(self.device, non_blocking=True)

    def prepare_slots(self, reqs: list[Req]) -> None:
        """Admit new owners to the sampler and mirror newly added pages."""
        upd_rows: list[int] = []
        upd_cols: list[int] = []
        upd_pages: list[int] = []
        for req in reqs:
            s = req.slot
            if self._owner[s] is not req:
                self._owner[s] = req
                self._synced[s] = 0
                self.sampler.admit(s, req.params, req.prompt_ids, self.eos_token_ids, req.output_ids)
            n = self._synced[s]
            new = req.pages[n:]
            if new:
                upd_rows.extend([s] * len(new))
                upd_cols.extend(range(n, n + len(new)))
                upd_pages.extend(new)
                self._synced[s] = len(req.pages)
        if upd_rows:
            dev = self._upload(upd_rows + upd_cols + upd_pages).view(3, -1)
            self.page_table.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eager path: (forward batch, sampler slots, steps, min_tokens_active)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        locs: list[int] = []
        indptr = [0]
        seq_lens: list[int] = []
        last: list[int] = []
        for req, toks, pre in zip(batch.reqs, batch.new_tokens, batch.prefix_lens):
            n = len(toks)
            ids.extend(toks)
            pages = req.pages
            for p in range(pre, pre + n):
                pos.append(p)
                locs.append(pages[p // ps] * ps + p % ps)
            indptr.append(indptr[-1] + n)
            seq_lens.append(pre + n)
            last.append(indptr[-1] - 1)
        rows = [i for i, s in enumerate(batch.samples) if s]
        sreqs = [batch.reqs[i] for i in rows]
        slots = [r.slot for r in batch.reqs]
        t, b, r = len(ids), len(batch.reqs), len(rows)
        packed = (ids + pos + locs + indptr + seq_lens + list(batch.prefix_lens) + slots
                  + [last[i] for i in rows] + [q.slot for q in sreqs] + [q.num_outputs for q in sreqs]
                  + [int(q.num_outputs < q.params.min_tokens) for q in sreqs])
        dev = self._upload(packed)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n
            return dev[o - n:o]

        input_ids, positions, out_loc = take(t), take(t), take(t)
        qo_indptr, d_seq, d_pre = take(b + 1), take(b), take(b)
        d_slots, logits_idx = take(b), take(r)
        s_slots, s_steps, s_min = take(r), take(r), take(r)
        attn = AttentionMetadata(
            page_size=ps,
            qo_indptr=qo_indptr.to(torch.int32),
            seq_lens=d_seq.to(torch.int32),
            prefix_lens=d_pre.to(torch.int32),
            page_table=self.page_table.index_select(0, d_slots),
            out_cache_loc=out_loc,
            seq_lens_host=seq_lens,
            prefix_lens_host=list(batch.prefix_lens),
            max_seq_len=max(seq_lens),
            max_extend_len=max(len(x) for x in batch.new_tokens),
        )
        fb = ForwardBatch(input_ids, positions, attn, self.kv_pool, self.attn_backend,
                          logits_indices=logits_idx, is_decode=batch.is_decode)
        return fb, s_slots, s_steps, s_min.bool()

    # ----- one step ------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprob | None] | None]:
        self.prepare_slots(batch.reqs)
        rows = [i for i, s in enumerate(batch.samples) if s]
        out: SampleOutput | None
        if self.graphs is not None and batch.is_decode and self.graphs.can_run(len(batch.reqs)):
            out = self.graphs.replay(batch.reqs)
        else:
            fb, slots, steps, min_active = self.build(batch)
            if not rows:
                # A non-final prefill chunk: only the KV matters; no logits, no sync.
                self.model(fb)
                return [], None
            logits = self.model(fb)  # [R, V] fp32
            out = self.sampler.sample(logits, slots, steps, min_active)
            self.sampler.update(slots, out.token_ids)
        return self._read_back(batch, rows, out)

    def _read_back(self, batch: ScheduledBatch, rows: list[int], out: SampleOutput,
                   ) -> tuple[list[int], list[TokenLogprob | None] | None]:
        reqs = [batch.reqs[i] for i in rows]
        # The step's one deliberate sync: the host needs the tokens to stream them.
        self.read_backs += 1
        with deliberate_sync():
            sampled: list[int] = out.token_ids[:len(rows)].tolist()
            want = any(r.params.logprobs is not None for r in reqs) and out.logprobs is not None
            if want:
                assert out.logprobs is not None and out.top_ids is not None
                assert out.top_logprobs is not None
                chosen = out.logprobs[:len(rows)].tolist()
                top_ids = out.top_ids[:len(rows)].tolist()
                top_lp = out.top_logprobs[:len(rows)].tolist()
        token_ids = [-1] * len(batch.reqs)
        for i, tok in zip(rows, sampled):
            token_ids[i] = tok
        if not want:
            return token_ids, None
        lps: list[TokenLogprob | None] = [None] * len(batch.reqs)
        for j, (i, r) in enumerate(zip(rows, reqs)):
            k = r.params.logprobs
            if k is not None:
                alts = tuple(zip(top_ids[j][:k], top_lp[j][:k]))
                lps[i] = TokenLogprob(sampled[j], float(chosen[j]), alts)
        return token_ids, lps
