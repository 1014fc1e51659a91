"""The input-grounded workload of `bestiary bench`: rewrite a given text (batch 1, greedy).

Each request is the engine's own chat-templated prompt `INSTRUCTION + passage`, the passage
~`tokens` tokens of the built-in calibration text (core.quant's data/weight_calibration.txt,
consecutive passages cut at line ends). The output copies much of its input, which is where
prompt lookup (speculative decoding, `--speculative ngram`) finds its drafts; on the random ids
of the other workloads it finds almost none.

Speed is the decode workload's definition, over all passages of one repeat:

    tok/s = sum_i (tokens(1 + N)_i - tokens(1)_i) / sum_i (t(1 + N)_i - t(1)_i)

(the tokens after the first over the time they added; a generation ends at the model's end id
or after 1 + N tokens), and the median over the repeats. The outputs of the 1 + N runs of the
first repeat are kept: greedy speculative decoding must reproduce the plain row's token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bestiary.core.bench.workload import Timed, added_rate, median_of

INSTRUCTION = "Rewrite the following text, keeping its meaning and wording, and fix any typos:\n\n"


def source_texts(tokenizer, count: int, tokens: int = 300) -> list[str]:
    """`count` consecutive ~`tokens`-token passages of the built-in calibration text (cut at lines)."""
    from bestiary.core.quant.calib_text import builtin_text

    lines = builtin_text("weight_calibration.txt").splitlines()
    out, current = [], []
    for line in lines:
        current.append(line)
        if len(tokenizer.encode("\n".join(current))) >= tokens:
            out.append("\n".join(current))
            current = []
            if len(out) == count:
                break
    return out


def rewrite_messages(text: str) -> list[dict]:
    """The conversation of one request: a user turn asking to rewrite `text`."""
    return [{"role": "user", "content": INSTRUCTION + text}]


def rewrite_problem(engine_dir: str | Path) -> str | None:
    """Why an engine dir cannot run the rewrite workload (no tokenizer, no chat template), or None."""
    from bestiary.core.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(engine_dir))
    if tok is None:
        return "has no tokenizer (tokenizer.json), which the rewrite prompts are encoded with"
    if not tok.chat_template:
        return "has no chat template (tokenizer_config.json: chat_template), which the rewrite prompts are written in"
    return None


@dataclass
class RewriteResult:
    """One system on the rewrite workload."""

    tokens_per_second: float | None  # median over the repeats; None: no repeat measured
    prompt_tokens: list[int]  # per passage: prompt length (chat template included)
    outputs: list[list[int]]  # per passage: the output ids of the first repeat's 1 + N run
    plain_label: str | None = None  # speculative rows: the plain row of the same engine
    vs_plain: float | None = None  # tokens_per_second / the plain row's
    differs: str | None = None  # where the output first differs from the plain row's ("text i, token j")

    def to_json(self) -> dict:
        return {"decode_tokens_per_second": self.tokens_per_second, "texts": len(self.prompt_tokens),
                "prompt_tokens": self.prompt_tokens, "generated_tokens": [len(o) for o in self.outputs],
                "plain_row": self.plain_label, "vs_plain": self.vs_plain,
                "output_equals_plain": None if self.plain_label is None else self.differs is None,
                "first_difference": self.differs}


Complete = Callable[[list[int], int], tuple[Timed, list[int]]]  # (prompt, n) -> time and output ids


def measure_rewrite(complete: Complete, prompts: list[list[int]], new_tokens: int, repeats: int) -> RewriteResult:
    """`repeats` times: each prompt generated to 1 and to 1 + new_tokens tokens (stopping at the end
    id); the median of the repeats' added_rate, and the first repeat's outputs."""
    runs: list[list[list[int]]] = []  # per repeat, per prompt: output ids

    def one_repeat() -> float | None:
        pairs, outputs = [], []
        for prompt in prompts:
            first, _ = complete(prompt, 1)
            full, ids = complete(prompt, 1 + new_tokens)
            pairs.append((first, full))
            outputs.append(ids)
        runs.append(outputs)
        return added_rate(pairs)

    rate = median_of(repeats, one_repeat)
    return RewriteResult(rate, [len(p) for p in prompts], runs[0])


def compare_to_plain(result: RewriteResult, plain: RewriteResult, plain_label: str) -> None:
    """Fill result's vs_plain and differs from the plain row of the same engine."""
    result.plain_label = plain_label
    if result.tokens_per_second and plain.tokens_per_second:
        result.vs_plain = result.tokens_per_second / plain.tokens_per_second
    result.differs = first_difference(result.outputs, plain.outputs)


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    """"text i, token j" where two lists of outputs first differ (a missing or extra token counts), or None."""
    if len(a) != len(b):
        return f"{len(a)} texts against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"text {i}, token {j}"
    return None
