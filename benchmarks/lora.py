"""LoRA benchmark on SmolLM2-135M-Instruct: many adapters in one batch, one run, interleaved.

Batch of 8 greedy requests (prompts of 24 tokens, 64 new tokens each), 4 distinct seeded random
rank-8 adapters on q, k, v, o, gate, up, down (two requests each):

  (a) bestiary decode step time with the adapters vs the same batch without them (the
      compiled CPU decode plan both times: its LoRA records add each row's own adapter's update);
  (b) generated tokens/s of bestiary with the adapters vs transformers + PEFT (unmerged
      adapters, a mixed batch through `adapter_names`, same prompts, same dtype, dense weights).

Rounds alternate ours / base / HF so a busy machine slows all three alike; medians are reported.

    python benchmarks/lora.py [--dtype bfloat16] [--rounds 3] [--new_tokens 64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, ADAPTERS, RANK, PROMPT_LEN = 8, 4, 8, 24


def dense_hf_dir(gguf: Path, out: Path) -> Path:
    """An HF dir with dense fp32 weights of the GGUF (transformers keeps a GGUF packed otherwise)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    return out


def make_adapters(hf_dir: Path, root: Path) -> list[Path]:
    """ADAPTERS seeded random rank-RANK PEFT adapters (B scaled to move the logits moderately)."""
    import peft
    import transformers

    dirs = []
    for i in range(ADAPTERS):
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS,
                                                          init_lora_weights=False))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 * (0.05 if "lora_B" in name else 1))
        model.save_pretrained(root / f"adapter{i}")
        dirs.append(root / f"adapter{i}")
    return dirs


def ours(llm, prompts, sampling, lora) -> tuple[float, float, int]:
    """(decode step seconds, generated tok/s, tokens) of one generate call."""
    llm.generate(prompts, sampling, lora=lora)
    s = llm.last_stats
    steps = sampling.max_new_tokens - 1
    return (s.seconds - s.first_token_seconds) / steps, s.generated_tokens / s.seconds, s.generated_tokens


def hf_peft(model, prompts, names, new_tokens: int) -> float:
    """Generated tok/s of transformers + PEFT on the mixed batch (equal-length prompts: no padding)."""
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, adapter_names=names, pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    import peft
    import transformers

    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.lora.request import LoraRequest
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gguf = demo_model_path()
        hf_dir = dense_hf_dir(gguf, root / "hf")
        dirs = make_adapters(hf_dir, root)
        convert(hf_dir, root / "ckpt", ConvertOptions(dtype=args.dtype), show_progress=False)
        build_engine(root / "ckpt", root / "engine", BuildConfig(max_batch_size=BATCH, max_seq_len=512))
        llm = LLM(root / "engine")
        vocab = llm.engine.model.config.vocab_size
        prompts = [torch.randint(100, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(BATCH)]
        slots = [i % ADAPTERS for i in range(BATCH)]
        lora = [LoraRequest(f"a{s}", dirs[s]) for s in slots]
        sampling = SamplingConfig(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
        hf = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype), dirs[0], adapter_name="a0")
        for s in range(1, ADAPTERS):
            hf.load_adapter(dirs[s], adapter_name=f"a{s}")
        hf.eval()
        names = [f"a{s}" for s in slots]
        ours(llm, prompts, SamplingConfig(temperature=0, max_new_tokens=4, ignore_eos=True), lora)  # warm-up, load
        ours(llm, prompts, SamplingConfig(temperature=0, max_new_tokens=4, ignore_eos=True), None)
        hf_peft(hf, prompts, names, 4)
        adapted, base, ref = [], [], []
        for i in range(args.rounds):
            adapted.append(ours(llm, prompts, sampling, lora))
            base.append(ours(llm, prompts, sampling, None))
            ref.append(hf_peft(hf, prompts, names, args.new_tokens))
            print(f"round {i}: {adapted[-1][0] * 1000:.1f} ms/step adapted, {base[-1][0] * 1000:.1f} ms/step base, "
                  f"HF + PEFT {ref[-1]:.1f} tok/s", flush=True)
        plan = llm.engine.model.__dict__.get("_decode_plans", {}).get(BATCH)
    step_l, step_b = statistics.median(a[0] for a in adapted), statistics.median(b[0] for b in base)
    tps_l, tps_ref = statistics.median(a[1] for a in adapted), statistics.median(ref)
    print(f"SmolLM2-135M-Instruct {args.dtype}, batch {BATCH}, {ADAPTERS} rank-{RANK} adapters on "
          f"{','.join(TARGETS)}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{args.rounds} interleaved rounds; compiled plan: {'yes' if plan is not None else 'NO'}")
    print(f"decode step: with adapters {step_l * 1000:.1f} ms, without {step_b * 1000:.1f} ms -> "
          f"{step_l / step_b:.2f}x (target <= 1.25x)")
    print(f"tokens/s (whole generate): bestiary + adapters {tps_l:.1f}, transformers + PEFT unmerged {tps_ref:.1f} -> "
          f"{tps_l / tps_ref:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
