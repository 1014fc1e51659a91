"""`bestiary eval --task summarize`: an engine's summaries against HF transformers', scored with ROUGE.

As TensorRT-LLM's examples/summarize.py: each article of a jsonl file (fields `article` and
`highlights`, as CNN/DailyMail) becomes the prompt `article + " TL;DR: "` (stripped, " n't" joined
to its word), encoded with the tokenizer's special tokens and cut to `max_input_len` tokens;
greedy generation of at most `max_output_len` tokens, by the engine (all articles in one
in-flight batch) and by transformers (one article at a time: no padding). Both are scored against
the highlights with the `rouge-score` package: ROUGE-1 / 2 / L / Lsum F-measure x 100, the mean
over articles (stemming on). Agreement: the articles whose engine summary equals HF's, and the mean
ROUGE-1 of the engine's summaries against HF's.

check_accuracy: pass when rouge1(engine) >= rouge1(HF) - rouge1_threshold (the issue's rule: the
engine may fall at most that far below HF on the same articles and prompt).

lora_dir: an HF PEFT adapter both models run with (the engine as a LoRA request on every article,
transformers through peft), so an adapter is checked against its reference the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@dataclass
class SummarizeReport:
    """ROUGE (x 100) of the engine's and HF's summaries, their agreement, and the check's verdict."""

    articles: int
    engine: dict[str, float]
    hf: dict[str, float]
    identical: int
    rouge1_vs_hf: float
    passed: bool | None = None  # None: no check asked
    engine_summaries: list[str] = field(default_factory=list, repr=False)


def read_articles(path: Path, limit: int | None = None) -> list[dict[str, str]]:
    """The (article, highlights) records of a jsonl file; a bad line is a one-line error naming it."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BestiaryError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("article", "highlights")):
            raise BestiaryError(f"{path}:{number}: expected an object with text fields 'article' and 'highlights'")
        records.append(record)
    if not records:
        raise BestiaryError(f"{path}: no articles")
    return records[:limit] if limit else records


def prompt_text(article: str) -> str:
    """TensorRT-LLM summarize.py's prompt."""
    return (article + " TL;DR: ").strip().replace(" n't", "n't")


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE F-measure x 100 of each key over the pairs."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    return {k: 100 * sum(s[k].fmeasure for s in scores) / len(scores) for k in ROUGE_KEYS}


def engine_summaries(llm: LLM, prompts: list[list[int]], max_output_len: int, lora_dir: Path | None = None) -> list[str]:
    """Greedy summaries of every prompt, in one in-flight batch (with the PEFT adapter `lora_dir`, if given)."""
    sampling = SamplingConfig(max_new_tokens=max_output_len, temperature=0.0)
    lora = LoraRequest(Path(lora_dir).name, str(lora_dir)) if lora_dir else None
    return [(c.text or "").strip() for c in llm.generate(prompts, sampling, lora=lora)]


def hf_summaries(hf_model_dir: Path, prompts: list[list[int]], max_output_len: int, eos: set[int],
                 lora_dir: Path | None = None) -> list[str]:
    """Greedy summaries by transformers (float32), one prompt at a time (with the PEFT adapter `lora_dir`,
    applied by peft, if given)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()
    if lora_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(lora_dir)).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])  # [1, P]
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_output_len, do_sample=False,
                               eos_token_id=sorted(eos) or None, pad_token_id=min(eos) if eos else 0)
            out.append(str(tokenizer.decode(y[0, x.shape[1]:].tolist(), skip_special_tokens=True)).strip())
    return out


def summarize(llm: LLM, dataset: Path, hf_model_dir: Path, max_output_len: int = 100, max_input_len: int = 923,
              max_articles: int | None = None, rouge1_threshold: float | None = None,
              lora_dir: Path | None = None) -> SummarizeReport:
    """Both models on the same articles and prompt; with rouge1_threshold, the check (module docstring)."""
    if llm.tokenizer is None:
        raise BestiaryError(f"{llm.engine.directory}: engine has no tokenizer; summarize needs one")
    records = read_articles(dataset, max_articles)
    prompts = [llm.tokenizer.encode(prompt_text(r["article"]))[:max_input_len] for r in records]
    ours = engine_summaries(llm, prompts, max_output_len, lora_dir)
    theirs = hf_summaries(hf_model_dir, prompts, max_output_len, llm.tokenizer.stop_ids, lora_dir)
    references = [r["highlights"] for r in records]
    report = SummarizeReport(len(records), rouge(ours, references), rouge(theirs, references),
                             sum(a == b for a, b in zip(ours, theirs)), rouge(ours, theirs)["rouge1"],
                             engine_summaries=ours)
    if rouge1_threshold is not None:
        report.passed = report.engine["rouge1"] >= report.hf["rouge1"] - rouge1_threshold
    return report
