"""`bestiary eval`: perplexity equals HF's exp(loss) on the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.evaluate import perplexity  # noqa: E402


def test_perplexity_matches_hf_with_chunks(tmp_path):
    src = make_tiny_llama(tmp_path)
    convert(src, tmp_path / "ckpt", show_progress=False)
    # max_num_tokens 16 forces chunked prefill through the paged cache within one window
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_seq_len=100, max_num_tokens=16))
    engine = Engine.load(tmp_path / "engine")
    ids = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    ours = perplexity(engine, ids)
    assert ours.tokens == 89
    assert abs(ours.nll - loss) < 1e-4
    assert math.isclose(ours.perplexity, math.exp(loss), rel_tol=1e-4)
