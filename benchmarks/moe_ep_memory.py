"""Expert parallelism: bytes per rank file of a Mixtral at tp 1, plain tp, ep and tp x ep.

A random Mixtral (hidden 256, 4 layers, 8 experts of FFN 1024, top-2, 8 heads / 4 kv heads, vocab
8000; 30.1M parameters, fp32) is converted once per layout and each rank file's size is printed as
a markdown table (docs/distributed.md#expert-parallelism-moe). The router, norms and embeddings are
replicated or TP-split as usual; the experts (25.2M of the parameters) are what ep divides.

Usage: python benchmarks/moe_ep_memory.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

CONFIG = dict(vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
LAYOUTS = {  # name -> ConvertOptions fields
    "tp 1": {},
    "tp 2 (experts split along FFN)": dict(tp_size=2),
    "ep 2 (tp 2, moe_tp 1)": dict(tp_size=2, moe_ep_size=2),
    "tp 4 (experts split along FFN)": dict(tp_size=4),
    "tp 2 x ep 2 (tp 4)": dict(tp_size=4, moe_tp_size=2, moe_ep_size=2),
    "ep 4 (tp 4, moe_tp 1)": dict(tp_size=4, moe_ep_size=4),
}


def main() -> None:
    import transformers

    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.checkpoint import rank_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="Where the source and checkpoints go (default: a temp dir).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))
        model.save_pretrained(root / "hf")
        params = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        print(f"random Mixtral: {params / 1e6:.1f}M parameters ({experts / 1e6:.1f}M in experts), fp32\n")
        print("| layout | rank files (MiB each) | largest rank / tp 1 |")
        print("|---|---|---|")
        whole = None
        for i, (name, kwargs) in enumerate(LAYOUTS.items()):
            out = convert(root / "hf", root / f"ckpt{i}", ConvertOptions(dtype="float32", **kwargs),
                          show_progress=False)
            sizes = [rank_file(out, r).stat().st_size for r in range(kwargs.get("tp_size", 1))]
            whole = whole or sizes[0]
            print(f"| {name} | {', '.join(f'{s / 2**20:.1f}' for s in sizes)} | {max(sizes) / whole:.2f} |")


if __name__ == "__main__":
    main()
