"""bestiary as an lm-evaluation-harness model: `bestiary lm-eval --model bestiary --model_args engine_dir=E ...`.

Importing this module registers the model "bestiary" in lm-eval's registry (lm-eval 0.4.9 finds
models by `register_model` at import only: no entry points), so from Python:

    import bestiary.core.bench.lm_eval_model  # noqa: F401 - registers "bestiary"
    lm_eval.simple_evaluate(model="bestiary", model_args="engine_dir=E", tasks=[...])

model_args: engine_dir (or pretrained: any source `LLM` takes: engine dir, checkpoint, HF dir,
GGUF), dtype (of a source converted on the fly), lora_dir (an HF PEFT adapter every request runs
with), max_batch_size (the batch: see below), device, num_threads, add_bos_token (as `hf`'s: encode
with the tokenizer's special tokens), max_length (the longest input; default the engine's),
max_gen_toks (default 256, as `hf`).

The batch is what lm-eval's `hf` batches: loglikelihood inputs scored per wave (core.bench.loglikelihood:
plus their shared contexts, each computed once) and prompts generated at once. It is max_batch_size
if given, else lm-eval's --batch_size when that is a number, else ("auto") the engine's
max_batch_size; the engine's max_batch_size bounds the sequences of each executor step.

loglikelihood / loglikelihood_rolling: core.bench.loglikelihood (each context computed once, its
continuations forked from it, batched through in-flight batching); generate_until: `LLM.generate` for
the requests with the same generation kwargs, a batch at a time.
Tokenization follows lm-eval's `hf` model (TemplateLM._encode_pair, no special tokens by default).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from bestiary.core.bench.lm_eval_compat import (
    MODEL_REGISTRY,
    TemplateLM,
    get_rolling_token_windows,
    handle_stop_sequences,
    make_disjoint_window,
)
from bestiary.core.bench.loglikelihood import max_score_length, score_continuations
from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

log = logging.getLogger(__name__)

MODEL_NAME = "bestiary"
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` default
GREEDY_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}


def _flag(value: Any) -> bool:
    """A model_args boolean: lm-eval passes text ("True", "false") or a bool."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def _batch(batch_size: Any) -> int | None:
    """lm-eval's --batch_size as a number of inputs, None for "auto" / "auto:N" (the engine's batch)."""
    text = str(batch_size).strip() if batch_size is not None else ""
    return int(text) if text.isdigit() and int(text) > 0 else None


def _positive(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise BestiaryError(f"--model_args {name}={value}: expected a positive integer")
    return number


class BestiaryLM(TemplateLM):
    """lm-eval's LM interface on `bestiary.core.runtime.llm.LLM` (module docstring)."""

    def __init__(self, engine_dir: str | None = None, pretrained: str | None = None, dtype: str = "auto",
                 lora_dir: str | None = None, max_batch_size: int | str | None = None, device: str | None = None,
                 num_threads: int | str | None = None, add_bos_token: bool | str = False,
                 max_length: int | str | None = None, max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
                 batch_size: Any = None, llm: LLM | None = None, **unused: Any) -> None:
        """Load the engine (or take `llm`, an LLM already loaded); see the module docstring for the args."""
        super().__init__()
        if unused:
            log.warning("bestiary: ignoring model_args %s", sorted(unused))
        source = engine_dir or pretrained
        if llm is None and not source:
            raise BestiaryError("--model_args: engine_dir=PATH is required (an engine dir, checkpoint, HF dir or GGUF)")
        self.max_in_flight = _positive(max_batch_size, "max_batch_size") or _batch(batch_size)  # before loading
        threads, longest = _positive(num_threads, "num_threads"), _positive(max_length, "max_length")
        self.max_gen_toks = _positive(max_gen_toks, "max_gen_toks") or DEFAULT_MAX_GEN_TOKS
        device = "cpu" if device in (None, "", "auto") else device
        self.llm = llm or LLM(str(source), dtype=dtype, num_threads=threads, device=device)
        if self.llm.tokenizer is None:
            raise BestiaryError(f"{self.llm.engine.directory}: engine has no tokenizer; lm-eval needs one")
        self.tokenizer = self.llm.tokenizer
        self.source = str(source or self.llm.engine.directory)
        self.lora = LoraRequest(Path(lora_dir).name, lora_dir) if lora_dir else None
        self.add_bos_token = _flag(add_bos_token)
        self._max_length = min(longest or max_score_length(self.llm), max_score_length(self.llm))

    # --- what TemplateLM asks for
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        if eos is None:
            raise BestiaryError(f"{self.tokenizer.source}: no eos_token; lm-eval needs one")
        return eos

    @property
    def prefix_token_id(self) -> int:
        """The context of an empty-context request: BOS, else EOS (as `hf`)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.source.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=self.add_bos_token if add_special_tokens is None
                                    else add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) text, context ids, continuation ids); all scored in one batch."""
        pairs = [(list(context), list(continuation)) for _, context, continuation in requests]
        results = score_continuations(self.llm, pairs, self.max_in_flight, self.lora)
        for (text, _, _), answer in zip(requests, results):
            if text is not None:
                self.cache_hook.add_partial("loglikelihood", text, answer)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p of every token of each text, in disjoint windows of max_length (as `hf`)."""
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for index, (text,) in enumerate(r.args for r in requests):
            tokens = self.tok_encode(text)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, score_continuations(self.llm, windows, self.max_in_flight, self.lora)):
            totals[owner] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generate for every request; those with the same generation kwargs go in one in-flight batch."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[repr(sorted(request.args[1].items()))].append(index)
        out: list[str] = [""] * len(requests)
        for indices in groups.values():
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate(contexts, dict(requests[indices[0]].args[1]))):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], kwargs: dict[str, Any]) -> list[str]:
        """Texts generated for `contexts` under lm-eval's generation kwargs, cut at the first `until` string."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = _positive(kwargs.pop("max_gen_toks", self.max_gen_toks), "max_gen_toks") or self.max_gen_toks
        sampling = self._sampling(kwargs, max_new, [u for u in until if u and u != eos])
        room = self.max_length - max_new
        if room < 1:
            raise BestiaryError(f"max_gen_toks {max_new} leaves no room for the prompt in max_length {self.max_length}")
        prompts: list[str | list[int]] = [self.tok_encode(c, left_truncate_len=room) for c in contexts]
        cap = self.max_in_flight or len(prompts)
        texts: list[str] = []
        for first in range(0, len(prompts), cap):
            for done in self.llm.generate(prompts[first:first + cap], sampling, lora=self.lora):
                text = done.text or ""
                for term in until:  # the earliest stop string ends the text, as `hf` cuts it
                    text = text.split(term)[0] if term else text
                texts.append(text)
        return texts

    @staticmethod
    def _sampling(kwargs: dict[str, Any], max_new: int, stops: list[str]) -> SamplingConfig:
        """lm-eval's gen kwargs as a SamplingConfig: greedy unless do_sample with a temperature > 0."""
        ignored = sorted(set(kwargs) - GREEDY_KEYS)
        if ignored:
            log.warning("bestiary: ignoring generation kwargs %s", ignored)
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        greedy = not _flag(kwargs.get("do_sample", False)) or temperature == 0.0
        return SamplingConfig(max_new_tokens=max_new, stop_strings=stops,
                              temperature=0.0 if greedy else temperature,
                              top_p=float(kwargs.get("top_p", 1.0) or 1.0), top_k=int(kwargs.get("top_k", 0) or 0))

    # --- chat templates
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The engine tokenizer's chat template (one per engine: a template name is not looked up)."""
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the engine's template; without the generation prompt, the last
        message is left open (transformers' continue_final_message, as `hf` asks)."""
        text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)
        if add_generation_prompt or not chat_history:
            return text
        last = chat_history[-1]["content"].strip()
        end = text.rfind(last)
        return text[: end + len(last)] if last and end >= 0 else text


def register() -> None:
    """Put BestiaryLM in lm-eval's registry as "bestiary" (once)."""
    if MODEL_REGISTRY.get(MODEL_NAME) is not BestiaryLM:
        MODEL_REGISTRY[MODEL_NAME] = BestiaryLM


register()
