"""Full vs incremental tokenization of a growing agentic conversation.

A synthetic coding-agent session (instructions, tool results with code and logs,
assistant replies) grows by about 2k tokens per turn up to 170k tokens. Each turn the
client resends the whole conversation; we render it with a Mistral-style chat template
and tokenize it twice: from scratch, and through the incremental cache. Both must give
the same ids (checked every turn). Uses the real v3 sentencepiece tokenizer shipped in
mistral-common.

    OMP_NUM_THREADS=1 python tools/bench/tokenizer.py [--target-tokens 170000] [--turn-tokens 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import mistral_common

from ftserve.tokenizer import ChatTemplate, IncrementalTokenizer, SentencePieceTokenizer

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

WORDS = (
    "the function returns a value when called with file path error test module import "
    "class self config request token cache prefix page expert layer batch stream async "
    "await def return if else for while try except raise assert None True False"
).split()
CODE = [
    "def {w}_{n}(self, {v}: int) -> int:",
    "    if {v} > {n}:",
    "        return self.{w}[{v}]",
    "    raise ValueError(f'bad {w}: {{{v}}}')",
    "{v} = [{w} for {w} in range({n})]  # 注释 {n}",
]


def turn_text(rng: random.Random, turn: int, approx_chars: int) -> tuple[str, str]:
    """(user message with a tool result, assistant reply) of about approx_chars together."""
    lines: list[str] = [f"Step {turn}: run the tests in tests/test_{rng.choice(WORDS)}.py and fix failures."]
    lines.append("Tool result:")
    size = len(lines[0])
    while size < approx_chars * 0.8:
        if rng.random() < 0.6:
            t = rng.choice(CODE)
            line = t.format(w=rng.choice(WORDS), v=rng.choice("xyzk"), n=rng.randint(0, 9999))
        else:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice(".!?:")
            if rng.random() < 0.1:
                line += " ✅ 完成 😀"
        lines.append(line)
        size += len(line) + 1
    reply = " ".join(rng.choice(WORDS) for _ in range(approx_chars // 30)) + "."
    return "\n".join(lines), reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-tokens", type=int, default=170_000)
    ap.add_argument("--turn-tokens", type=int, default=2_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    data = os.path.join(os.path.dirname(mistral_common.__file__), "data")
    tok = SentencePieceTokenizer(os.path.join(data, "mistral_instruct_tokenizer_240323.model.v3"))
    template = ChatTemplate(TEMPLATE, tok.bos_token, tok.eos_token)
    cache = IncrementalTokenizer(tok)
    rng = random.Random(args.seed)
    chars_per_turn = int(args.turn_tokens * 3.3)  # ~3.3 chars per token for this mix

    messages: list[dict[str, str]] = []
    reply = ""
    rows: list[tuple[int, int, float, float, float]] = []
    prev_prompt = ""
    print(f"{'turn':>4} {'tokens':>8} {'new':>6} {'full ms':>9} {'incr ms':>9} {'ratio':>7} "
          f"{'floor ms':>9}")
    n_tokens = 0
    turn = 0
    while n_tokens < args.target_tokens:
        turn += 1
        user, next_reply = turn_text(rng, turn, chars_per_turn)
        if reply:
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": user})
        reply = next_reply
        prompt = template.render(messages)
        t0 = time.perf_counter()
        full = tok.encode(prompt, add_special_tokens=False)
        t1 = time.perf_counter()
        incr = cache.encode(prompt)
        t2 = time.perf_counter()
        if incr != full:
            raise SystemExit(f"turn {turn}: incremental ids differ from the full tokenization")
        # The floor: tokenizing only the characters this turn added, nothing else.
        assert prompt.startswith(prev_prompt)
        t3 = time.perf_counter()
        tok.encode_continuation(prompt[len(prev_prompt):])
        floor = time.perf_counter() - t3
        prev_prompt = prompt
        new = len(full) - n_tokens
        n_tokens = len(full)
        rows.append((turn, n_tokens, t1 - t0, t2 - t1, floor))
        print(f"{turn:>4} {n_tokens:>8} {new:>6} {(t1 - t0) * 1e3:>9.2f} {(t2 - t1) * 1e3:>9.2f} "
              f"{(t1 - t0) / (t2 - t1):>6.1f}x {floor * 1e3:>9.2f}")

    full_total = sum(r[2] for r in rows)
    incr_total = sum(r[3] for r in rows[1:]) + rows[0][2]  # turn 1 has nothing to reuse
    last = rows[-1]
    s = cache.stats
    print()
    print(f"turns={len(rows)} final_tokens={last[1]} identical_ids=all")
    print(f"last turn: full {last[2] * 1e3:.1f} ms, incremental {last[3] * 1e3:.1f} ms, "
          f"ratio {last[2] / last[3]:.1f}x")
    print(f"median ratio over turns 2..{len(rows)}: "
          f"{statistics.median(r[2] / r[3] for r in rows[1:]):.1f}x")
    print(f"whole session: full {full_total:.2f} s, incremental {incr_total:.2f} s, "
          f"ratio {full_total / incr_total:.1f}x")
    print(f"incremental vs floor (tokenizing only the new text), median over turns: "
          f"{statistics.median(r[3] / r[4] for r in rows[1:]):.1f}x the floor")
    print(f"cache: prefix_hits={s.prefix_hits} fallbacks={s.fallbacks} misses={s.misses} "
          f"tokens_reused={s.tokens_reused} cache_bytes={cache.nbytes}")


if __name__ == "__main__":
    main()
