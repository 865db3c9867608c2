"""Deterministic synthetic conversation text with heavy-tailed lengths.

Lengths are drawn in *tokens* and rendered as words at ``TOKENS_PER_WORD`` (a typical ratio for
English under BPE / sentencepiece vocabularies), so a target of 1,000 tokens becomes ~770 words.
Every generator takes an explicit ``random.Random`` so a run is reproducible from ``--seed``
regardless of how the event loop interleaves sessions.
"""

from __future__ import annotations

import json
import keyword
import math
import random
import re

TOKENS_PER_WORD = 1.3

_WORDS = (
    "the a of to and in is that for it with as on be this are by from at or an was have not "
    "can will which but if more when there all so into than then also about would each other "
    "function module request server cache token latency memory buffer thread queue session "
    "context prompt model expert layer kernel batch page prefix stream error result value "
    "update check test build deploy config option default parameter return state handler "
    "file path directory commit branch merge diff patch review change fix issue report "
    "because however therefore instead although while before after during without within "
    "quickly carefully exactly probably usually again still already never always often "
    "compute measure verify allocate release schedule dispatch encode decode parse render"
).split()

_IDENTS = (
    "alloc_pages free_pages radix_insert match_prefix schedule_step run_decode sample_tokens "
    "load_weights build_model tokenize detokenize page_table seq_lens expert_ids slot_map "
    "handle_request stream_chunks"
).split()

# Parameter names of generated source: plain words that are not Python keywords.
_ARGS = tuple(w for w in _WORDS[:60] if not keyword.iskeyword(w))

_TOOLS = ("read_file", "run_tests", "grep", "list_dir", "http_get", "sql_query")


def draw_length(rng: random.Random, mean: float, dist: str, sigma: float, cap: int) -> int:
    """A heavy-tailed positive integer with the given mean (before clipping to [1, cap]).

    lognormal: mu = ln(mean) - sigma^2 / 2 keeps E[X] = mean.
    pareto: alpha = 1 + 1 / sigma (sigma 1.0 -> alpha 2, finite mean, infinite variance),
    scale x_m = mean * (alpha - 1) / alpha keeps E[X] = mean.
    """
    if mean <= 0:
        return 1
    if dist == "lognormal":
        x = rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)
    elif dist == "pareto":
        alpha = 1.0 + 1.0 / max(sigma, 1e-3)
        x = mean * (alpha - 1.0) / alpha * rng.paretovariate(alpha)
    elif dist == "fixed":
        x = mean
    else:
        raise ValueError(f"unknown length distribution {dist!r} (lognormal | pareto | fixed)")
    return max(1, min(cap, int(round(x))))


def words_for_tokens(tokens: int) -> int:
    return max(1, int(round(tokens / TOKENS_PER_WORD)))


_ALPHA = re.compile(r"[A-Za-z]+")
_DIGIT = re.compile(r"\d")
_PUNCT = re.compile(r"[^\w\s]|_")
_LINE = re.compile(r"\n")
_INDENT = re.compile(r"(?<=\n) {2,}")


def approx_tokens(text: str) -> int:
    """Tokenizer-free estimate: letter runs ~1.2 tokens, digits 1 each (Llama-style vocabularies
    split numbers), punctuation ~0.8, a newline and an indent 1 each (code). Sessions rescale it
    by the server's reported prompt_tokens, so what matters is that prose and tool output come
    out at similar ratios: with the demo's sentencepiece vocabulary, real / estimate is
    0.82-0.93 for prose and 0.72-1.09 for tool output (1.34 before newlines and indents
    counted; the agentic ceiling's 0.8 margin assumes ~25%)."""
    alpha = len(_ALPHA.findall(text))
    rest = len(_DIGIT.findall(text)) + len(_LINE.findall(text)) + len(_INDENT.findall(text))
    return int(1.2 * alpha + 0.8 * len(_PUNCT.findall(text)) + rest) + 1


def prose(rng: random.Random, tokens: int) -> str:
    n = words_for_tokens(tokens)
    out: list[str] = []
    sentence = 0
    for _ in range(n):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() if sentence == 0 else w)
        sentence += 1
        if sentence > 6 and rng.random() < 0.15:
            out[-1] += "."
            sentence = 0
    return " ".join(out) + "."


def code_block(rng: random.Random, tokens: int) -> str:
    """Python-looking source: identifiers and punctuation tokenize denser than prose."""
    lines: list[str] = ["```python"]
    budget = tokens
    while budget > 0:
        name = rng.choice(_IDENTS)
        arg = rng.choice(_WORDS)
        block = [f"def {name}_{rng.randrange(100)}({arg}: int) -> int:"]
        for _ in range(rng.randint(1, 4)):
            block.append(f"    {arg} = {rng.choice(_IDENTS)}({arg}, {rng.randrange(1000)})")
        block.append(f"    return {arg}")
        lines.extend(block)
        budget -= approx_tokens("\n".join(block))
    lines.append("```")
    return "\n".join(lines)


def json_blob(rng: random.Random, tokens: int) -> str:
    items: list[dict[str, object]] = []
    budget = tokens
    while budget > 0 or not items:
        item = {"id": len(items), "name": rng.choice(_IDENTS), "ok": rng.random() < 0.9,
                "ms": round(rng.random() * 100, 2), "note": f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}"}
        items.append(item)
        budget -= approx_tokens(json.dumps(item, separators=(",", ":")))
    return json.dumps({"results": items}, separators=(",", ":"))


def tool_output(rng: random.Random, tokens: int) -> str:
    """What an agent's tool returns: a header, then code or JSON."""
    tool = rng.choice(_TOOLS)
    body = code_block(rng, tokens) if rng.random() < 0.5 else json_blob(rng, tokens)
    return f"[tool {tool} returned]\n{body}"


def source_file(rng: random.Random, tokens: int) -> str:
    """A Python module of about ``tokens`` tokens (by approx_tokens): constants, then
    functions with docstrings, loops and calls between them, as a file an agent
    would be asked to edit."""
    consts = [f"{rng.choice(_IDENTS).upper()}_{i} = {rng.randrange(1, 5000)}" for i in range(4)]
    parts = ['"""' + prose(rng, 24).rstrip(".") + '."""', "", "import math", "import os", "",
             *consts, ""]
    names: list[str] = []
    budget = tokens - approx_tokens("\n".join(parts))
    while budget > 0:
        name = f"{rng.choice(_IDENTS)}_{len(names)}"
        arg, other = rng.sample(_ARGS, 2)
        body = [f"def {name}({arg}: int, {other}: int = {rng.randrange(1, 64)}) -> int:",
                f'    """{prose(rng, 12).rstrip(".").capitalize()}."""',
                "    total = 0",
                f"    for i in range({arg}):"]
        for _ in range(rng.randint(1, 3)):
            callee = rng.choice(names) if names and rng.random() < 0.5 else "math.isqrt"
            body.append(f"        total += {callee}(i + {other})" if callee != "math.isqrt"
                        else f"        total += math.isqrt(i * {rng.randrange(2, 99)} + {other})")
        body.append(f"    if total > {consts[rng.randrange(len(consts))].split(' = ')[0]}:")
        body.append(f"        return total - {rng.randrange(1, 100)}")
        body.append("    return total")
        names.append(name)
        parts.extend([*body, "", ""])
        budget -= approx_tokens("\n".join(body)) + 2
    return "\n".join(parts).rstrip() + "\n"


def small_edit(rng: random.Random, source: str) -> tuple[str, str]:
    """(instruction, edited source): one small change to ``source``: a function
    renamed everywhere, a constant's value changed, or a line added."""
    funcs = re.findall(r"^def (\w+)\(", source, flags=re.M)
    consts = re.findall(r"^([A-Z_0-9]+) = (\d+)$", source, flags=re.M)
    kind = rng.choice(("rename", "constant", "line")) if funcs else "constant"
    if kind == "rename":
        old = rng.choice(funcs)
        new = old.replace("_", "", 1) + "_v2"
        return (f"Rename the function `{old}` to `{new}`, everywhere it is used.",
                re.sub(rf"\b{old}\b", new, source))
    if kind == "constant":
        name, value = rng.choice(consts)
        new_value = str(int(value) * 2 + 1)
        return (f"Change the value of `{name}` from {value} to {new_value}.",
                re.sub(rf"^{name} = {value}$", f"{name} = {new_value}", source, flags=re.M))
    name = rng.choice(funcs)
    return (f"In `{name}`, add the line `    total = max(total, 0)` just before its last "
            "`return total`.",
            _insert_before_last_return(source, name))


def _insert_before_last_return(source: str, func: str) -> str:
    lines = source.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {func}("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("def ")), len(lines))
    last = max(i for i in range(start, end) if lines[i] == "    return total")
    return "\n".join(lines[:last] + ["    total = max(total, 0)"] + lines[last:])


def system_prompt(rng: random.Random, tokens: int) -> str:
    return "You are a coding agent working in a large repository. " + prose(rng, tokens)


def user_turn(rng: random.Random, tokens: int) -> str:
    return prose(rng, tokens)
