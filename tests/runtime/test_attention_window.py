"""Sliding-window attention and attention sinks, end to end.

HF parity of tiny Mixtral / Mistral with sliding_window 16 past the window; sinks + window
against HF LLaMA run with a 4D mask of exactly those positions; the paged KV cache releasing
blocks out of the window (a 2,000-token generation holds O(window) blocks); the mixed
in-flight workload with windows; the compiled CPU decode attention; limits and errors.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.build_config import BuildConfig, finalize_build_config  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.kernels.attention_window import layer_window, releasable_blocks  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.executor import Executor  # noqa: E402
from bestiary.core.runtime.kv_cache import KvCacheConfig  # noqa: E402
from bestiary.core.runtime.kv_window import held  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
WINDOW = 16
PROMPT = [(7 * i + 3) % 120 for i in range(48)]  # 48 tokens: three windows
STEPS = 32
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW)


def hf_model(name: str):
    torch.manual_seed(0)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
        return parity.reinit_(transformers.MixtralForCausalLM(cfg))
    return parity.reinit_(transformers.MistralForCausalLM(transformers.MistralConfig(**TINY)))


@pytest.fixture(scope="module", params=["mixtral", "mistral"])
def windowed(request, tmp_path_factory):
    """(HF model, engine) of a tiny Mixtral or Mistral with sliding_window 16."""
    model = hf_model(request.param)
    base = tmp_path_factory.mktemp(request.param)
    convert(parity.save_hf(model, base), base / "ckpt", show_progress=False)
    return model, Engine.load(base / "ckpt")


def executor(engine, kv_cache_config: KvCacheConfig | None = None, **limits) -> Executor:
    build = finalize_build_config(BuildConfig(tokens_per_block=8, **limits), engine.config.model_dump())
    return Executor(engine.model, build, kv_cache_config=kv_cache_config)


def run_checked(ex: Executor, reqs) -> None:
    """Step until done, checking the KV accounting after every step; the pool is whole at the end."""
    while ex.has_work:
        ex.step()
        ex.check_kv_accounting()
    ex.allocator.check_whole()


# --- HF parity past the window -------------------------------------------------------------


def test_window_is_the_models_and_does_not_cap_lengths(windowed):
    _, engine = windowed
    assert engine.config.sliding_window == WINDOW
    assert engine.config.max_position_embeddings == 256  # not capped at the window any more
    assert engine.model.attention_windows == [WINDOW, WINDOW]
    build = finalize_build_config(BuildConfig(max_seq_len=64), engine.config.model_dump())
    assert build.max_seq_len == 64


def test_logits_match_hf_past_the_window(windowed):
    """Every position of a 48-token prompt and 32 decode steps within 1e-4 * max|HF| (EngineRunner:
    eager prefill, CPU decode plan or compiled decode attention); full attention misses by far."""
    model, engine = windowed
    worst, scale = parity.prefill_and_decode_diffs(engine, model, PROMPT, steps=STEPS)
    tol = parity.tolerance(torch.tensor([scale]))
    print(f"{engine.config.architecture} window {WINDOW}: max diff {worst:.3g}, tolerance {tol:.3g}")
    assert worst <= tol
    for attn in (m for m in engine.model.modules() if hasattr(m, "window")):
        attn.window = 0
    full, _ = parity.prefill_and_decode_diffs(engine, model, PROMPT, steps=4)
    for attn in (m for m in engine.model.modules() if hasattr(m, "window")):
        attn.window = WINDOW
    assert full >= 100 * tol


def test_executor_greedy_and_logits_equal_hf(windowed):
    """Through the executor (blocks released out of the window, chunked prefill): the greedy tokens
    equal HF's generate and every generated step's logits are within 1e-4 * max|HF|."""
    model, engine = windowed
    expected, near_tie = parity.hf_greedy(model, PROMPT, STEPS)
    ex = executor(engine, max_num_tokens=20)
    req = ex.add(PROMPT, SamplingConfig(max_new_tokens=STEPS, output_generation_logits=True, **GREEDY))
    run_checked(ex, [req])
    assert parity.greedy_mismatch(req.output, expected, near_tie) is None
    ref = parity.hf_logits(model, PROMPT + req.output)[len(PROMPT) - 1 : -1]  # [STEPS, V]
    ours = torch.stack(req.chooser.logits).float()
    assert (ours - ref).abs().max().item() <= parity.tolerance(ref)
    assert ex.allocator.peak_used <= math.ceil(WINDOW / 8) + 1 + math.ceil(20 / 8)  # window + one prefill chunk


# --- sinks + window against a reference that attends to exactly those positions --------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base = tmp_path_factory.mktemp("window_llama")
    src = make_tiny_llama(base, max_position_embeddings=4096)
    convert(src, base / "ckpt", show_progress=False)
    return transformers.LlamaForCausalLM.from_pretrained(src).eval(), Engine.load(base / "ckpt")


def masked_logits(model, ids: list[int], window: int, sinks: int) -> torch.Tensor:
    """HF logits [len(ids), V] with a 4D mask: query q sees key j iff j <= q and (j < sinks or q - j < window - sinks)."""
    q, j = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None, :]
    visible = (j <= q) & ((j < sinks) | (q - j < window - sinks))
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        return model(torch.tensor([ids]), attention_mask=mask).logits[0].float()


@pytest.mark.parametrize("per_request", [False, True])
def test_sinks_and_window_equal_the_masked_reference(llama, per_request):
    """Sinks 4, window 60 (engine-wide, or on the request): prompt and generated logits and greedy
    tokens equal HF LLaMA attending to exactly the 4 sinks and the last 56 positions."""
    model, engine = llama
    window, sinks, prompt = 60, 4, [(5 * i + 1) % 96 for i in range(70)]
    own = dict(max_attention_window=window, sink_token_length=sinks)
    ex = executor(engine, max_num_tokens=32, **({} if per_request else own))
    sampling = SamplingConfig(max_new_tokens=40, output_context_logits=True, output_generation_logits=True,
                              **(own if per_request else {}), **GREEDY)
    req = ex.add(prompt, sampling)
    run_checked(ex, [req])
    ref = masked_logits(model, prompt + req.output, window, sinks)  # [110, V]
    ours = torch.cat([torch.cat(req.context_logits), torch.stack(req.chooser.logits).float()[1:]])
    assert (ours - ref[:-1]).abs().max().item() <= parity.tolerance(ref)
    assert req.output == [int(row.argmax()) for row in ref[len(prompt) - 1 : -1]]
    full = masked_logits(model, prompt + req.output, 10**6, 0)
    assert (full - ref).abs().max().item() >= 100 * parity.tolerance(ref)  # the window is not a no-op


# --- the paged KV cache under a window -------------------------------------------------------


def test_long_generation_holds_window_blocks(llama):
    """2,000 tokens under window 64 (tokens_per_block 8): a sequence never holds more than
    ceil(64 / 8) + 1 blocks (+ 1 for 4 sinks, over 500 tokens); a pool of 24 blocks suffices."""
    _, engine = llama
    for sinks, bound, total in ((0, math.ceil(64 / 8) + 1, 2000), (4, math.ceil(64 / 8) + 2, 500)):
        ex = executor(engine, max_seq_len=2048, max_input_len=16, max_num_tokens=16, max_attention_window=64,
                      sink_token_length=sinks, max_tokens_in_paged_kv_cache=24 * 8)
        req = ex.add(list(range(1, 9)), SamplingConfig(max_new_tokens=total - 8, **GREEDY))
        most = 0
        while ex.has_work:
            ex.step()
            most = max(most, len(held(req.blocks)), ex.allocator.num_used)
        print(f"window 64, sinks {sinks}: {total} tokens, most blocks held {most} (bound {bound})")
        assert len(req.tokens) == total and most <= bound
        ex.allocator.check_whole()


def test_released_blocks_are_never_read(llama):
    """Released blocks filled with NaN at once (no reuse: nothing keeps them): same tokens."""
    _, engine = llama
    prompts = [[(3 * i + k) % 96 for i in range(n)] for k, n in ((1, 45), (2, 9), (3, 70))]
    outputs = []
    for poison in (False, True):
        ex = executor(engine, KvCacheConfig(enable_block_reuse=False), max_batch_size=3, max_num_tokens=24,
                      max_attention_window=20, sink_token_length=2)
        if poison:
            free = ex.allocator.free

            def free_and_poison(blocks, free=free, kv=ex.kv):
                free(blocks)
                for b in blocks:
                    kv.k[:, b], kv.v[:, b] = float("nan"), float("nan")

            ex.allocator.free = free_and_poison
        reqs = [ex.add(p, SamplingConfig(max_new_tokens=30, **GREEDY)) for p in prompts]
        run_checked(ex, reqs)
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1]


def test_mixed_workload_with_windows_equals_each_alone(llama):
    """Requests with their own windows / sinks (or none) arriving at different steps, chunked prefill,
    shared prefixes reused, a small batch and pool: the same greedy tokens as each run alone."""
    _, engine = llama
    rng = random.Random(1)
    stem = [rng.randrange(96) for _ in range(40)]
    work = []
    for i in range(10):
        prompt = stem[: rng.randint(16, 40)] + [rng.randrange(96) for _ in range(rng.randint(3, 40))]
        window = [None, 12, 24, 33][i % 4]
        sinks = rng.choice([0, 3]) if window else None
        work.append((prompt, rng.randint(2, 40), dict(max_attention_window=window, sink_token_length=sinks)))

    def alone(prompt, n, own):
        ex = executor(engine, max_seq_len=256)
        req = ex.add(prompt, SamplingConfig(max_new_tokens=n, **own, **GREEDY))
        run_checked(ex, [req])
        return req.output

    ex = executor(engine, max_seq_len=256, max_batch_size=3, max_num_tokens=24, max_tokens_in_paged_kv_cache=64 * 8)
    reqs, pending = [], list(work)
    while pending or ex.has_work:
        if pending and rng.random() < 0.5:
            prompt, n, own = pending.pop(0)
            reqs.append(ex.add(prompt, SamplingConfig(max_new_tokens=n, **own, **GREEDY)))
        ex.step()
        ex.check_kv_accounting()
    ex.allocator.check_whole()
    assert ex.allocator.stats.hit_blocks > 0  # prefixes were reused
    for (prompt, n, own), req in zip(work, reqs):
        assert req.output == alone(prompt, n, own), own


def test_prefix_reuse_keys_include_the_window(llama):
    """A prompt computed under one window is not reused by a request under another (their K/V differ),
    and is reused under the same one."""
    _, engine = llama
    prompt = [(11 * i + 2) % 96 for i in range(40)]
    ex = executor(engine, max_seq_len=256)
    for window, hits in ((None, 0), (16, 0), (16, 4), (None, 4)):
        before = ex.allocator.stats.hit_blocks
        req = ex.add(prompt, SamplingConfig(max_new_tokens=2, max_attention_window=window, **GREEDY))
        run_checked(ex, [req])
        assert ex.allocator.stats.hit_blocks - before == hits, window


def test_releasable_blocks_keep_sinks_and_the_window():
    assert list(releasable_blocks(40, 0, 0, 8)) == []  # no window
    assert list(releasable_blocks(40, 16, 0, 8)) == [0, 1, 2]  # next query 40 sees 25..40
    assert list(releasable_blocks(40, 16, 4, 8)) == [1, 2]  # sees 0..3 and 29..40: block 0 holds the sinks
    assert list(releasable_blocks(10, 16, 4, 8)) == []


# --- per-layer windows, limits and errors ----------------------------------------------------


def test_layer_types_give_interleaved_windows():
    from types import SimpleNamespace

    config = SimpleNamespace(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert [layer_window(config, i) for i in range(3)] == [8, 0, 8]
    config.use_sliding_window = False
    assert layer_window(config, 0) == 0


def test_window_limits_and_errors(llama):
    _, engine = llama
    ex = executor(engine, max_attention_window=32)
    with pytest.raises(BestiaryError, match="max_attention_window 64 exceeds the engine's max_attention_window 32"):
        ex.add([1, 2], SamplingConfig(max_attention_window=64))
    with pytest.raises(BestiaryError, match="sink_token_length 32 must be smaller than the attention window 32"):
        ex.add([1, 2], SamplingConfig(sink_token_length=32))
    with pytest.raises(BestiaryError, match="sink_token_length 4 needs an attention window"):
        executor(engine).add([1, 2], SamplingConfig(sink_token_length=4))
    with pytest.raises(BestiaryError, match="--sink_token_length 8: must be smaller than --max_attention_window 8"):
        finalize_build_config(BuildConfig(max_attention_window=8, sink_token_length=8), engine.config.model_dump())
    with pytest.raises(BestiaryError, match="--sink_token_length 4: needs --max_attention_window"):
        finalize_build_config(BuildConfig(sink_token_length=4), engine.config.model_dump())


def test_interleaved_window_layers_match_hf_exaone4(tmp_path):
    """EXAONE 4 hybrid (layer_types: 3 sliding layers with window 16, then a full one): per-layer
    windows match HF past the window; the full layer keeps every block (nothing is released)."""
    torch.manual_seed(0)
    cfg = transformers.Exaone4Config(**{k: v for k, v in TINY.items() if k != "num_hidden_layers"},
                                     num_hidden_layers=4, sliding_window_pattern=4)
    model = parity.reinit_(transformers.Exaone4ForCausalLM(cfg))
    convert(parity.save_hf(model, tmp_path), tmp_path / "ckpt", show_progress=False)
    engine = Engine.load(tmp_path / "ckpt")
    assert engine.model.attention_windows == [WINDOW, WINDOW, WINDOW, 0]
    worst, scale = parity.prefill_and_decode_diffs(engine, model, PROMPT, steps=16)
    tol = parity.tolerance(torch.tensor([scale]))
    assert worst <= tol
    attns = [m for m in engine.model.modules() if hasattr(m, "window")]
    for windows in ([WINDOW] * 4, [0] * 4):  # one window for every layer is wrong both ways
        for attn, w in zip(attns, windows):
            attn.window = w
        assert parity.prefill_and_decode_diffs(engine, model, PROMPT, steps=2)[0] >= 100 * tol, windows
    for attn, w in zip(attns, [WINDOW, WINDOW, WINDOW, 0]):
        attn.window = w
    ex = executor(engine)
    req = ex.add(PROMPT, SamplingConfig(max_new_tokens=8, **GREEDY))
    assert req.release_window == 0
    run_checked(ex, [req])
    assert ex.allocator.peak_used == math.ceil((48 + 8) / 8)


def test_interleaved_layers_release_nothing(llama):
    """Layer 0 windowed (12), layer 1 full: the windowed layer attends through its window (the
    output differs from both all-full and all-windowed) but no block is released, since layer 1
    still sees every key; the tokens equal the step-by-step EngineRunner's."""
    _, engine = llama
    attns = [layer.attention.attn for layer in engine.model.transformer.layers]
    prompt = [(3 * i) % 96 for i in range(30)]

    def greedy(windows):
        for attn, w in zip(attns, windows):
            attn.window = w
        ex = executor(engine, max_seq_len=256)
        req = ex.add(prompt, SamplingConfig(max_new_tokens=10, **GREEDY))
        run_checked(ex, [req])
        return req, ex

    try:
        req, ex = greedy([12, 0])
        assert req.release_window == 0 and ex.allocator.peak_used == math.ceil(40 / 8)
        runner, seq = parity.EngineRunner(engine), list(prompt)
        logits = runner.feed(seq)
        for _ in range(10):
            seq.append(int(logits[-1].argmax()))
            logits = runner.feed(seq[-1:])
        assert seq[len(prompt):] == req.output
        assert greedy([0, 0])[0].output != req.output != greedy([12, 12])[0].output
    finally:
        for attn in attns:
            attn.window = 0


# --- the window on the command line and in serve requests ------------------------------------

CLI_PROMPT = [(5 * i + 1) % 300 for i in range(30)]
CLI_SETTINGS = [(None, None), (8, 0), (8, 2)]  # (max_attention_window, sink_token_length); None: the engine's


@pytest.fixture(scope="module")
def window_engine(tmp_path_factory):
    """A tiny LLaMA with a tokenizer, built by `bestiary build --max_attention_window 16 --sink_token_length 0`."""
    from tiny_chat import make_tiny_chat_hf

    from bestiary.core.cli.main import main

    base = tmp_path_factory.mktemp("window_cli")
    convert(make_tiny_chat_hf(base), base / "ckpt", show_progress=False)
    assert main(["build", "--checkpoint_dir", str(base / "ckpt"), "--output_dir", str(base / "engine"),
                 "--max_seq_len", "128", "--tokens_per_block", "8", "--max_attention_window", "16",
                 "--sink_token_length", "0"]) == 0
    build = Engine.load(base / "engine").build
    assert (build.max_attention_window, build.sink_token_length) == (16, 0)
    return base / "engine"


def window_sampling(window: int | None, sinks: int | None) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=12, max_attention_window=window, sink_token_length=sinks, **GREEDY)


@pytest.fixture(scope="module")
def api_outputs(window_engine) -> list[list[int]]:
    """LLM.generate's ids of CLI_PROMPT under each of CLI_SETTINGS (each setting changes them)."""
    from bestiary.core.runtime.llm import LLM

    llm = LLM(window_engine)
    outputs = [llm.generate([CLI_PROMPT], window_sampling(w, s))[0].output_ids for w, s in CLI_SETTINGS]
    assert len({tuple(ids) for ids in outputs}) == len(CLI_SETTINGS), outputs  # every setting matters here
    return outputs


def window_flags(window: int | None, sinks: int | None) -> list[str]:
    return [*(["--max_attention_window", str(window)] if window else []),
            *(["--sink_token_length", str(sinks)] if sinks is not None else [])]


def test_run_window_flags_equal_the_python_api(window_engine, api_outputs, capsys):
    """`bestiary run --max_attention_window W --sink_token_length S` (0 accepted) prints the ids of
    LLM.generate with SamplingConfig(max_attention_window=W, sink_token_length=S)."""
    from bestiary.core.cli.main import main

    for (window, sinks), expected in zip(CLI_SETTINGS, api_outputs, strict=True):
        argv = ["run", "--engine_dir", str(window_engine), "--input_ids", ",".join(map(str, CLI_PROMPT)),
                "--max_output_len", "12", "--ignore_eos", "--output_ids", *window_flags(window, sinks)]
        assert main(argv) == 0
        assert [int(t) for t in capsys.readouterr().out.split()] == expected, (window, sinks)


@pytest.mark.parametrize("command, flags, words", [
    ("run", ["--sink_token_length", "-1"], "argument --sink_token_length: '-1': expected an integer >= 0"),
    ("run", ["--max_attention_window", "0"], "argument --max_attention_window: '0': expected a positive integer"),
    ("build", ["--sink_token_length", "-1"], "argument --sink_token_length: '-1': expected an integer >= 0"),
    ("build", ["--max_attention_window", "0"], "argument --max_attention_window: '0': expected a positive integer"),
])
def test_window_flag_values_are_argparse_errors(window_engine, capsys, command, flags, words):
    """Out-of-range flag values: exit 2, argparse's usage line and one error line naming the flag."""
    from bestiary.core.cli.main import main

    where = ["--engine_dir", str(window_engine), "--input_ids", "1,2"] if command == "run" else \
        ["--checkpoint_dir", str(window_engine), "--output_dir", str(window_engine.parent / "unused")]
    with pytest.raises(SystemExit) as exit_:
        main([command, *where, *flags])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "Traceback" not in err
    assert words in err.splitlines()[-1], err
    assert not (window_engine.parent / "unused").exists()


@pytest.mark.parametrize("flags, words", [
    (["--max_attention_window", "32"], "max_attention_window 32 exceeds the engine's max_attention_window 16"),
    (["--max_attention_window", "8", "--sink_token_length", "8"],
     "sink_token_length 8 must be smaller than the attention window 8"),
])
def test_run_window_limits_are_one_line_errors(window_engine, capsys, flags, words):
    from cli_errors import one_line

    one_line(capsys, ["run", "--engine_dir", str(window_engine), "--input_ids", "1,2,3", *flags], 2, words)


def test_serve_requests_take_window_fields(window_engine, api_outputs):
    """`max_attention_window` / `sink_token_length` as extra request fields (in-process app): the text of
    LLM.generate's ids under the same settings; out-of-range values are 400s naming the problem."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.serve.app import ServeSettings, create_app

    testclient = pytest.importorskip("fastapi.testclient")
    llm = LLM(window_engine)
    body = dict(model="tiny", prompt=CLI_PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    with testclient.TestClient(create_app(llm, ServeSettings(served_model_name="tiny"))) as client:
        for (window, sinks), expected in zip(CLI_SETTINGS, api_outputs, strict=True):
            extra = {k: v for k, v in (("max_attention_window", window), ("sink_token_length", sinks)) if v is not None}
            reply = client.post("/v1/completions", json=body | extra)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == llm.tokenizer.decode(expected), (window, sinks)
        for extra, words in (({"max_attention_window": 32}, "exceeds the engine's max_attention_window 16"),
                             ({"sink_token_length": -1}, "sink_token_length: Input should be greater than or equal to 0"),
                             ({"max_attention_window": 8, "sink_token_length": 8}, "must be smaller than the attention window 8")):
            reply = client.post("/v1/completions", json=body | extra)
            assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text


# --- the compiled CPU decode attention -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_attention_with_windows(cpu_build, dtype):
    """kernels.c's decode attention == its torch reference under windows and sinks, with every block
    outside the windows holding NaN (never read); on every build (cpu_build), float32 and bfloat16
    q and pools (float32 out: the bf16 dot products sum in float32 too)."""
    from bestiary.core.kernels.cpu import ops

    torch.manual_seed(0)
    bs, h, kvh, d = 5, 4, 2, 24
    lens, windows, sinks = [63, 5, 40, 29, 7], [16, 60, 8, 0, 3], [4, 4, 0, 0, 1]
    width = max(-(-n // bs) for n in lens)
    order = torch.randperm(len(lens) * width)
    tables = order.view(len(lens), width)
    k_pool = torch.randn(len(lens) * width, bs, kvh, d).to(dtype)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(len(lens), h, d).to(dtype)
    bounds = (windows, sinks)
    kv_lens = torch.tensor(lens)
    ref = ops.decode_attention_ref(q.float(), k_pool, v_pool, tables, kv_lens, d**-0.5, None, None, bounds)
    plain = ops.decode_attention_ref(q.float(), k_pool, v_pool, tables, kv_lens, d**-0.5)
    assert (ref - plain).abs().max() > 1e-2  # the windows matter here
    for i, (n, w, s) in enumerate(zip(lens, windows, sinks)):
        for b in releasable_blocks(n - 1, w, s, bs):
            k_pool[tables[i, b]], v_pool[tables[i, b]] = float("nan"), float("nan")
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, None, None, bounds, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
