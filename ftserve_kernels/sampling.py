"""Sampling math on fixed shapes: counter-based noise, penalties, filter masks,
grammar bitmasks.

Everything here is elementwise, a gather/scatter with fixed index shapes, a
sort, or a reduction along the vocabulary: no data-dependent shapes and no
host reads, so a caller can capture it in a CUDA graph.

Counter-based randomness
------------------------
A sampled token must depend only on (request seed, output index), never on the
batch it shares or its row, so noise is a pure function of

    (seed_lo, seed_hi)  the request's 64-bit seed, as two 32-bit halves
    step                the index of the output token being sampled
    token               the vocabulary index

hashed with ``mix32`` (a 32-bit integer finalizer; bijective, full avalanche):

    k1 = mix32(seed_lo ^ mix32(step ^ GOLDEN))
    k2 = mix32(seed_hi ^ mix32(k1 ^ SALT))
    h  = mix32(mix32(mix32(token ^ GOLDEN) ^ k1) ^ k2)
    u  = ((h >> 9) + 0.5) / 2^23        in [2^-24, 1 - 2^-24], exact in fp32
    e  = max(-log(u), E_MIN)            standard exponential, > 0
    g  = -log(e)                        standard Gumbel, in about [-2.8, 17.3]

and the sample is argmax(scores + g) (Gumbel-max: exactly a draw from
softmax(scores)). Values are 32-bit quantities held in int64 tensors; products
are split into 16-bit halves so nothing overflows int64 (the Triton twin uses
native uint32 arithmetic, which wraps the same way).

The noise must stay finite: a masked score is -inf, and -inf + inf is NaN,
which torch.argmax takes as the maximum (a banned token drawn), while +inf on
an allowed token draws it whatever its probability. So u never reaches 0 or 1:
23 bits plus a half fit fp32's 24-bit significand exactly (24 bits plus a half
do not: the top value rounded to 1.0), and e is floored at E_MIN, below the
smallest exact -log(u) (about 2^-24), in case a device's fast log rounds a u
just under 1 to log 0 (then e would be 0 and g +inf).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
SALT = 0x85EBCA6B
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
NEG_INF = float("-inf")
# Longest top-k that filters without sorting the vocabulary (filter_triton; the
# sampler's wide_filter stage above it).
SHORT_K = 256
U_BITS = 23  # hash bits in a uniform: with the half, exact in fp32's significand
U_SCALE = 1.0 / (1 << U_BITS)
E_MIN = 2.0**-25  # floor of the exponential -log(u): no-op where log is exact


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """A signed or unsigned 64-bit seed as (low, high) 32-bit halves."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s & M32, s >> 32


def row_keys(
    seed_lo: torch.Tensor,  # [B] int64 in [0, 2^32)
    seed_hi: torch.Tensor,  # [B] int64 in [0, 2^32)
    steps: torch.Tensor,  # [B] int64, output index
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row 32-bit keys (k1, k2), each [B] int64."""
    k1 = mix32(seed_lo ^ mix32((steps & M32) ^ GOLDEN))
    k2 = mix32(seed_hi ^ mix32(k1 ^ SALT))
    return k1, k2


def token_hash_table(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """mix32(token ^ GOLDEN) for every token: [V] int64, computed once."""
    return mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ GOLDEN)


def uniform_ref(
    k1: torch.Tensor,  # [B] int64
    k2: torch.Tensor,  # [B] int64
    token_hash: torch.Tensor,  # [V] int64, from token_hash_table
) -> torch.Tensor:
    """Uniforms in [2^-24, 1 - 2^-24]: [B, V] fp32, a pure function of (keys, token)."""
    h = mix32(mix32(token_hash[None, :] ^ k1[:, None]) ^ k2[:, None])  # [B, V]
    return uniform_of_hash(h)


def uniform_of_hash(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 holding [0, 2^32)) -> fp32 uniforms strictly inside
    (0, 1): the top U_BITS bits plus a half, every value exact (see the module)."""
    return ((h >> (32 - U_BITS)).to(torch.float32) + 0.5) * U_SCALE


def gumbel_of_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of uniforms in (0, 1), finite for every u."""
    return -torch.log((-torch.log(u)).clamp_min(E_MIN))


def gumbel_argmax_ref(
    scores: torch.Tensor,  # [B, V] fp32, -inf = excluded
    k1: torch.Tensor,  # [B] int64
    k2: torch.Tensor,  # [B] int64
    token_hash: torch.Tensor,  # [V] int64
) -> torch.Tensor:
    """One draw per row from softmax(scores): [B] int64. The noise is finite, so
    an excluded token stays -inf and is drawn only from a row with nothing else."""
    gumbel = gumbel_of_uniform(uniform_ref(k1, k2, token_hash))  # [B, V]
    return (scores + gumbel).argmax(dim=-1)


def apply_penalties_ref(
    logits: torch.Tensor,  # [B, V] fp32
    counts: torch.Tensor,  # [B, V] int32, generated-token counts
    prompt_mask: torch.Tensor,  # [B, V] bool, token appears in the prompt
    repetition: torch.Tensor,  # [B] fp32, 1 = off
    presence: torch.Tensor,  # [B] fp32, 0 = off
    frequency: torch.Tensor,  # [B] fp32, 0 = off
) -> torch.Tensor:
    """HF repetition penalty (prompt + generated tokens), then OpenAI presence and
    frequency penalties (generated tokens only). Neutral values are exact no-ops.
    """
    seen = counts > 0  # [B, V]
    rep = repetition[:, None]  # [B, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    out = torch.where(seen | prompt_mask, penalized, logits)  # [B, V]
    out = out - counts.to(torch.float32) * frequency[:, None]
    return out - seen.to(torch.float32) * presence[:, None]


def mask_token_ids(
    logits: torch.Tensor,  # [B, V] fp32
    ids: torch.Tensor,  # [B, M] int64, padding may be any valid id
    active: torch.Tensor,  # [B, M] bool, False = padding or not masked this step
) -> torch.Tensor:
    """Set logits[b, ids[b, m]] to -inf where active[b, m], whatever the logit was
    (an added -inf would make +inf a NaN). A fixed-shape scatter of True into a
    [B, V + 1] table whose last column absorbs the inactive entries, so every
    write is the same value and duplicates are harmless; then a where."""
    vocab = logits.shape[1]
    cols = torch.where(active, ids, vocab)  # [B, M], inactive -> the sink column
    banned = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, cols, True)  # [B, V + 1]
    return torch.where(banned[:, :vocab], NEG_INF, logits)


def mask_words(vocab_size: int) -> int:
    """int32 words in one token bitmask row (bit t % 32 of word t // 32 = token t)."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V] fp32
    words: torch.Tensor,  # [B, W] int32, W = mask_words(V); bit set = allowed
    word_of: torch.Tensor,  # [V] int64, t // 32
    bit_of: torch.Tensor,  # [V] int32, t % 32
) -> torch.Tensor:
    """Logits of tokens whose bit is clear -> -inf. Fixed shapes: a gather of each
    token's word, a shift, a where; an all-ones row (-1) changes nothing."""
    bits = (words.index_select(1, word_of) >> bit_of) & 1  # [B, V] int32
    return torch.where(bits != 0, logits, NEG_INF)


def top_k_top_p_keep(
    scaled: torch.Tensor,  # [B, V] fp32, after temperature
    top_k: torch.Tensor,  # [B] int64, V = off
    top_p: torch.Tensor,  # [B] fp32, 1 = off
) -> torch.Tensor:
    """Tokens kept by top-k, then top-p over the top-k-renormalized distribution
    (vLLM order). Ties at the top-k boundary go to the lower token id.
    Returns [B, V] bool.
    """
    vocab = scaled.shape[-1]
    # Stable sort: equal logits keep id order, so the kept set is well defined.
    vals, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=scaled.device)  # [V]
    keep = rank[None, :] < top_k[:, None]  # [B, V]
    vals = torch.where(keep, vals, NEG_INF)
    probs = torch.softmax(vals, dim=-1)  # [B, V]
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
    # top_p == 1 keeps everything even where rounding pushes `before` to 1.
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    return torch.zeros_like(keep).scatter(1, order, keep)


def min_p_keep(
    scaled: torch.Tensor,  # [B, V] fp32, after temperature
    min_p: torch.Tensor,  # [B] fp32, 0 = off
) -> torch.Tensor:
    """p >= min_p * p_max, i.e. scaled >= max + log(min_p): [B, V] bool.
    Relative to the max, so it does not depend on renormalization order."""
    top = scaled.max(dim=-1, keepdim=True).values  # [B, 1]
    return scaled >= top + torch.log(min_p)[:, None]


# -- Triton twin of gumbel_argmax_ref: noise generated in registers ----------
# The reference materializes several [B, V] int64 temporaries per step; the
# kernel reads the scores once. Grid (rows, chunks): each program reduces one
# vocabulary chunk to (best value, lowest index at it); a tiny torch argmax over
# the chunks finishes, keeping torch.argmax's first-index tie rule.

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on CUDA and in CI
    triton = None

if triton is not None:
    # Globals read inside a jit function must be constexpr.
    _C1_TL = tl.constexpr(_C1)
    _C2_TL = tl.constexpr(_C2)
    _GOLDEN_TL = tl.constexpr(GOLDEN)
    _SALT_TL = tl.constexpr(SALT)

    @triton.jit
    def _mix32_tl(x):
        """lowbias32 on uint32 (wraps mod 2^32 like the reference)."""
        x = x ^ (x >> 16)
        x = x * tl.full(x.shape, _C1_TL, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full(x.shape, _C2_TL, tl.uint32)
        return x ^ (x >> 16)

    _E_MIN_TL = tl.constexpr(E_MIN)
    _U_SHIFT_TL = tl.constexpr(32 - U_BITS)
    _U_SCALE_TL = tl.constexpr(U_SCALE)

    @triton.jit
    def _gumbel_tl(idx, k1, k2):
        """The Gumbel noise of tokens ``idx`` under row keys (k1, k2), uint32: as
        token_hash_table, uniform_of_hash and gumbel_of_uniform (finite always)."""
        th = _mix32_tl(idx.to(tl.uint32) ^ tl.full(idx.shape, _GOLDEN_TL, tl.uint32))
        h = _mix32_tl(_mix32_tl(th ^ k1) ^ k2)
        u = ((h >> _U_SHIFT_TL).to(tl.float32) + 0.5) * _U_SCALE_TL
        return -tl.log(tl.maximum(-tl.log(u), _E_MIN_TL))

    @triton.jit
    def _argmax_combine(v1, i1, v2, i2):
        """Larger value wins; on equal values the lower index (torch.argmax rule)."""
        take1 = (v1 > v2) | ((v1 == v2) & (i1 < i2))
        return tl.where(take1, v1, v2), tl.where(take1, i1, i2)

    @triton.jit
    def _gumbel_argmax_kernel(
        scores_ptr, k1_ptr, k2_ptr, best_v_ptr, best_i_ptr,
        vocab, stride_row, chunk,
        NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.program_id(1)
        k1 = tl.load(k1_ptr + row).to(tl.uint32)
        k2 = tl.load(k2_ptr + row).to(tl.uint32)
        lane = tl.arange(0, BLOCK)
        best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = tl.full((BLOCK,), 0, tl.int32)  # not tl.zeros: see the reduce below
        start = c * chunk
        for off in range(start, start + chunk, BLOCK):
            idx = off + lane  # [BLOCK] int32
            ok = idx < vocab
            s = tl.load(scores_ptr + row.to(tl.int64) * stride_row + idx, mask=ok,
                        other=float("-inf"))
            v = s + _gumbel_tl(idx, k1, k2)
            # Strict >: a lane's indices grow, so the first maximum stays.
            take = (v > best_v) & ok
            best_v = tl.where(take, v, best_v)
            best_i = tl.where(take, idx, best_i)
        # Own combine fn rather than tl.max/tl.argmax: those are jit functions
        # decorated at triton import, which breaks switching to the interpreter later.
        m, first = tl.reduce((best_v, best_i), 0, _argmax_combine)
        tl.store(best_v_ptr + row * NUM_CHUNKS + c, m)
        tl.store(best_i_ptr + row * NUM_CHUNKS + c, first)


def vocab_chunks(rows: int, vocab: int, block: int, target_programs: int) -> tuple[int, int]:
    """(chunk, chunks per row): BLOCK-aligned vocabulary chunks, about
    target_programs programs over all rows, so a short batch still fills the GPU."""
    blocks = triton.cdiv(vocab, block)
    num_chunks = max(1, min(blocks, triton.cdiv(target_programs, rows)))
    chunk = triton.cdiv(blocks, num_chunks) * block
    return chunk, triton.cdiv(vocab, chunk)


def gumbel_argmax_triton(
    scores: torch.Tensor,  # [B, V] fp32
    k1: torch.Tensor,  # [B] int64
    k2: torch.Tensor,  # [B] int64
    block: int = 1024,
    target_programs: int = 512,
) -> torch.Tensor:
    """Same draw as gumbel_argmax_ref (up to fp32 log rounding): [B] int64.
    Shapes depend only on (B, V), so it is graph-capturable."""
    assert triton is not None, "triton is not installed"
    scores = scores.contiguous()
    rows, vocab = scores.shape
    chunk, num_chunks = vocab_chunks(rows, vocab, block, target_programs)
    best_v = torch.empty(rows, num_chunks, dtype=torch.float32, device=scores.device)
    best_i = torch.empty(rows, num_chunks, dtype=torch.int32, device=scores.device)
    _gumbel_argmax_kernel[(rows, num_chunks)](
        scores, k1.contiguous(), k2.contiguous(), best_v, best_i,
        vocab, scores.stride(0), chunk, NUM_CHUNKS=num_chunks, BLOCK=block,
    )
    pick = best_v.argmax(dim=-1, keepdim=True)  # [B, 1], first chunk on ties
    return best_i.gather(1, pick).squeeze(1).to(torch.int64)
