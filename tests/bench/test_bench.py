"""`bestiary bench` on a tiny engine: the report's figures, peers skipped (never a crash), errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_errors import one_line
from tiny_llama import make_tiny_engine

from bestiary.core.bench.config import BenchConfig
from bestiary.core.bench.workload import (
    Timed,
    decode_rate,
    median_of,
    mixed_workload,
    percentile,
    prompt_ids,
)

SMALL = ["--new_tokens", "24", "--repeats", "3", "--prompt_lens", "8", "40", "--mixed_requests", "5",
         "--mixed_prompt_lens", "3", "12", "--mixed_output_lens", "2", "6", "--num_threads", "1", "--bandwidth_mib", "64"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("bench"))


def bench_json(capsys, *argv: str) -> dict:
    from bestiary.core.cli.main import main

    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mixed_workload_is_seeded_and_in_range():
    a = mixed_workload(40, 1000, (16, 384), (16, 128), seed=3)
    assert a == mixed_workload(40, 1000, (16, 384), (16, 128), seed=3)
    assert a != mixed_workload(40, 1000, (16, 384), (16, 128), seed=4)
    assert all(16 <= len(p) <= 384 for p in a.prompts) and all(16 <= n <= 128 for n in a.max_new)
    assert all(100 <= t < 1000 for p in a.prompts for t in p)
    assert a.asked == sum(a.max_new)
    assert all(0 <= t < 96 for t in prompt_ids(50, 96, 0))  # a tiny vocabulary keeps its ids in range


def test_percentile_and_decode_rate():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 99) == 5.0
    # 0.5 s to the first token then 10 ms a token: prefill is not counted
    assert decode_rate(lambda n: Timed(0.5 + 0.01 * (n - 1), n), 64) == pytest.approx(100.0)
    # a system that stopped at an end id after 33 tokens: the 32 after the first count
    assert decode_rate(lambda n: Timed(0.5 + 0.01 * (min(n, 33) - 1), min(n, 33)), 64) == pytest.approx(100.0)
    # the longer run no faster than the short one (a busy machine): no figure rather than a wild one
    assert decode_rate(lambda n: Timed(2.0 if n == 1 else 1.5, n), 64) is None
    assert median_of(3, iter([None, 2.0, 4.0]).__next__) == 3.0 and median_of(2, lambda: None) is None


def test_config_refuses_bad_ranges():
    with pytest.raises(ValueError, match="mixed_prompt_lens 9..3"):
        BenchConfig(mixed_prompt_lens=(9, 3))
    with pytest.raises(ValueError, match="unknown workload 'train'"):
        BenchConfig(workloads=["train"])


class DriftingSystem:
    """A fake system whose speed is its base rate times the machine's phase at open time."""

    bytes_per_token = 1000
    max_prompt_len = None

    def __init__(self, name: str, rate: float, phases: list[float], opened: list[str]):
        self.name, self.rate, self.phase = name, rate, phases.pop(0)
        opened.append(name)

    def generate(self, prompt: list[int], n: int) -> Timed:
        return Timed(n / (self.rate * self.phase), n)

    def mixed(self, work):
        from bestiary.core.bench.workload import MixedResult

        seconds = 100 / (self.rate * self.phase)
        return MixedResult(seconds, [seconds] * len(work.prompts), 100)

    def close(self) -> None:
        pass


def test_rounds_measure_every_system_in_turn_and_report_the_median_round():
    """--rounds 3: A, B, A, B, A, B opened in that order; each figure the median of the 3 rounds. The
    machine runs at 1.0, 0.5 (a slow phase) and 0.9 of its speed: alone, each round's ratio is off by
    the phase; the medians are 0.9 x each base rate, so B / A = 2 as the systems are."""
    from bestiary.core.bench.peers import Candidate
    from bestiary.core.bench.run import run_bench

    opened: list[str] = []
    phases = [1.0, 1.0, 0.5, 0.5, 0.9, 0.9]  # at each open, in order
    cands = [Candidate(n, n, open=lambda n=n, r=r: DriftingSystem(n, r, phases, opened))
             for n, r in (("A", 10.0), ("B", 20.0))]
    config = BenchConfig(rounds=3, repeats=1, new_tokens=4, prompt_lens=[8], mixed_requests=2, bandwidth_mib=0)
    report = run_bench(config, cands, vocab=96)
    assert opened == ["A", "B"] * 3
    a, b = report.rows
    assert a.decode_tps == pytest.approx(9.0) and b.decode_tps == pytest.approx(18.0)
    assert a.ttft[8] == pytest.approx(1 / 9.0) and b.ttft[8] == pytest.approx(1 / 18.0)
    assert a.mixed.tokens_per_second == pytest.approx(9.0) and b.mixed.tokens_per_second == pytest.approx(18.0)
    assert not phases  # one open per system and round


def test_bandwidth_is_the_best_probe_of_the_run(monkeypatch):
    """A probe before the run and before each later round; the limit is the best (a busy phase slows a probe)."""
    from bestiary.core.bench import machine as machine_mod
    from bestiary.core.bench import run as run_mod
    from bestiary.core.bench.peers import Candidate
    from bestiary.core.bench.run import run_bench

    probes = iter([30.0, 45.0, 38.0])
    monkeypatch.setattr(machine_mod, "read_bandwidth_gbps", lambda mib: next(probes))
    monkeypatch.setattr(run_mod, "read_bandwidth_gbps", lambda mib: next(probes))
    cands = [Candidate("A", "A", open=lambda: DriftingSystem("A", 10.0, [1.0] * 3, []))]
    config = BenchConfig(rounds=3, repeats=1, new_tokens=4, prompt_lens=[8], mixed_requests=2, bandwidth_mib=8)
    report = run_bench(config, cands, vocab=96)
    assert report.machine.read_gbps_probes == [30.0, 45.0, 38.0] and report.machine.read_gbps == 45.0


def test_rounds_flag_reaches_the_tables(tiny, capsys):
    from bestiary.core.cli.main import main

    assert main(["bench", "--engine_dir", str(tiny / "engine"), "--workloads", "decode", "--rounds", "2",
                 "--new_tokens", "4", "--repeats", "1", "--num_threads", "1", "--bandwidth_mib", "0"]) == 0
    assert "median of 1, median of 2 rounds" in " ".join(capsys.readouterr().out.split())


def test_engine_and_hf_measured_missing_peers_skipped(tiny, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # None in sys.modules: ImportError on import
    monkeypatch.setitem(sys.modules, "ftllm", None)
    report = bench_json(capsys, "--engine_dir", str(tiny / "engine"), "--compare", "hf,llama.cpp,fastllm",
                        "--hf_model", str(tiny / "hf"), "--hf_dtypes", "float32", *SMALL)
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"engine", "hf", "llama.cpp", "fastllm"}
    assert "llama-cpp-python is not installed" in rows["llama.cpp"]["skipped"]
    assert "ftllm is not installed" in rows["fastllm"]["skipped"]
    for name in ("engine", "hf"):
        row = rows[name]
        assert row["skipped"] is None and row["decode_tokens_per_second"] > 0
        assert row["ttft_seconds"]["8"] > 0 and row["ttft_seconds"]["40"] > 0
        assert row["mixed"]["generated"] == sum(mixed_workload(5, 96, (3, 12), (2, 6), 0).max_new)
        assert 0 < row["mixed"]["p50_seconds"] <= row["mixed"]["p99_seconds"] <= row["mixed"]["seconds"]
    assert report["machine"]["read_gbps"] > 0 and report["machine"]["threads"] == 1


def test_prompts_over_the_engine_limit_are_not_timed(tiny, capsys):
    """The tiny engine takes prompts of at most 95 tokens: TTFT 200 is reported as not measured."""
    report = bench_json(capsys, "--engine_dir", str(tiny / "engine"), "--workloads", "prefill",
                        *SMALL[:4], "--prompt_lens", "8", "200", "--num_threads", "1", "--bandwidth_mib", "0")
    (row,) = report["rows"]
    assert row["ttft_seconds"]["200"] is None and row["ttft_seconds"]["8"] > 0
    assert row["decode_tokens_per_second"] is None and row["mixed"] is None
    assert report["machine"]["read_gbps"] is None  # --bandwidth_mib 0


def test_bytes_per_token_leaves_out_an_untied_embedding(tiny):
    from bestiary.core.bench.systems import engine_bytes_per_token

    engine = tiny / "engine"
    files = sum(f.stat().st_size for f in engine.glob("rank*.safetensors"))
    tied, untied = engine_bytes_per_token(engine, True), engine_bytes_per_token(engine, False)
    assert tied - untied == 96 * 64 * 4  # the fp32 embedding table [vocab, hidden]
    assert files - 10_000 < tied <= files  # every tensor, less the file's header


def test_tables_and_skipped_lines(tiny, capsys, monkeypatch):
    from bestiary.core.cli.main import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    argv = ["bench", "--engine_dir", str(tiny / "engine"), "--compare", "llama.cpp,hf", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch-1 decode" in out and "prefill" in out and "mixed" in out
    assert "skipped llama.cpp: llama-cpp-python is not installed" in out
    assert "skipped hf: no --hf_model" in out


def test_speculative_rows_report_acceptance(tiny, capsys):
    """--speculative ngram: a second engine row that decodes speculatively, with the decode and mixed
    workloads' drafted / accepted counts in --json and a line each under the tables."""
    from bestiary.core.cli.main import main

    spec = ["--speculative", "ngram", "--num_draft_tokens", "3", "--fixed_draft_tokens"]  # counts: tokens only
    argv = ["--engine_dir", str(tiny / "engine"), "--workloads", "decode", "mixed", *SMALL, *spec]
    report = bench_json(capsys, *argv)
    plain, fast = report["rows"]
    assert plain["label"] == "bestiary engine" and plain["speculative"] is None
    assert fast["label"] == "bestiary engine + ngram k=3" and fast["decode_tokens_per_second"] > 0
    assert set(fast["speculative"]) == {"decode", "mixed"}
    decode = fast["speculative"]["decode"]
    # the random model's greedy output loops, so prompt lookup finds drafts and some are right
    assert 0 < decode["accepted_tokens"] <= decode["drafted_tokens"] <= 3 * decode["steps"]
    assert decode["acceptance_rate"] == decode["accepted_tokens"] / decode["drafted_tokens"]
    assert decode["tokens_per_step"] == (decode["accepted_tokens"] + decode["steps"]) / decode["steps"]
    # the timed runs only (not the warm-up): 3 repeats of 1 + 24 tokens, the first from the prompt step
    assert decode["accepted_tokens"] + decode["steps"] <= 3 * 24
    assert fast["mixed"]["generated"] == plain["mixed"]["generated"]
    assert main(["bench", *argv]) == 0
    out = capsys.readouterr().out
    assert "bestiary engine + ngram k=3" in out
    rate = decode["acceptance_rate"]
    assert (f"bestiary engine + ngram k=3, decode: accepted {decode['accepted_tokens']} of "
            f"{decode['drafted_tokens']} draft tokens ({rate:.0%})") in out  # greedy: the same counts again


def test_report_names_the_cpu_kernel_build(tiny, capsys, monkeypatch):
    """Header and JSON say which build of the compiled CPU kernels the engines ran: the best this
    CPU runs, or the one BESTIARY_CPU_ISA forces (avx2 here: the engine then ran the AVX2 build)."""
    from bestiary.core.cli.main import main
    from bestiary.core.kernels.cpu import build

    if build.library() is None or "avx2" not in build.supported_isas():
        pytest.skip("no compiled AVX2 kernels on this machine")
    argv = ["--engine_dir", str(tiny / "engine"), "--workloads", "decode", "--new_tokens", "4",
            "--repeats", "1", "--num_threads", "1", "--bandwidth_mib", "0"]
    monkeypatch.delenv(build.ISA_ENV_VAR, raising=False)
    build.library.cache_clear()
    try:
        machine = bench_json(capsys, *argv)["machine"]
        best = build.supported_isas()[0]
        assert (machine["cpu_isa"], machine["cpu_kernels"]) == (best, "best the CPU runs")
        monkeypatch.setenv(build.ISA_ENV_VAR, "avx2")
        build.library.cache_clear()
        assert main(["bench", *argv]) == 0
        assert f"CPU kernels: avx2 (forced by {build.ISA_ENV_VAR})" in capsys.readouterr().out
        assert build.library().bst_isa() == build.ISAS["avx2"].code  # what the engine ran
        assert bench_json(capsys, *argv)["machine"]["cpu_isa"] == "avx2"
    finally:
        build.library.cache_clear()


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory) -> Path:
    """The tiny LLaMA with a BPE tokenizer and ChatML (tests/helpers/tiny_chat.py), built to take the rewrite
    prompts (~190 tokens with this small vocabulary)."""
    from tiny_chat import make_tiny_chat_hf

    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import convert

    base = tmp_path_factory.mktemp("bench-chat")
    convert(make_tiny_chat_hf(base), base / "ckpt", show_progress=False)
    return build_engine(base / "ckpt", base / "engine",
                        BuildConfig(max_batch_size=4, max_seq_len=320, max_input_len=256, tokens_per_block=8))


REWRITE = ["--workloads", "rewrite", "--rewrite_texts", "2", "--rewrite_text_tokens", "40", "--new_tokens", "24",
           "--repeats", "2", "--num_threads", "1", "--bandwidth_mib", "0"]


def test_rewrite_workload_plain_and_prompt_lookup(chat_engine, capsys):
    """--workloads rewrite: the engine's chat prompt "Rewrite the following text ..." per passage; the
    ngram row's output is the plain row's token for token, its acceptance is counted and printed,
    and its speed is divided by the plain row's."""
    from bestiary.core.bench.rewrite import INSTRUCTION
    from bestiary.core.cli.main import main
    from bestiary.core.runtime.tokenizer import Tokenizer

    argv = ["--engine_dir", str(chat_engine), *REWRITE, "--speculative", "ngram", "--num_draft_tokens", "4",
            "--fixed_draft_tokens"]  # the same counts in both runs (the adaptive k follows step timings)
    report = bench_json(capsys, *argv)
    plain, fast = report["rows"]
    assert report["config"]["workloads"] == ["rewrite"] and plain["decode_tokens_per_second"] is None
    a, b = plain["rewrite"], fast["rewrite"]
    tok = Tokenizer.from_dir(chat_engine)
    assert a["texts"] == b["texts"] == 2 and a["prompt_tokens"] == b["prompt_tokens"]
    assert a["prompt_tokens"][0] > len(tok.encode(INSTRUCTION)) + 40  # instruction + passage + template
    assert 1 < a["generated_tokens"][0] <= 25 and a["generated_tokens"] == b["generated_tokens"]
    assert a["decode_tokens_per_second"] > 0 and b["decode_tokens_per_second"] > 0
    assert a["output_equals_plain"] is None and b["output_equals_plain"] is True and b["plain_row"] == plain["label"]
    assert b["vs_plain"] == pytest.approx(b["decode_tokens_per_second"] / a["decode_tokens_per_second"])
    spec = fast["speculative"]["rewrite"]
    assert plain["speculative"] is None and set(fast["speculative"]) == {"rewrite"}
    assert 0 < spec["accepted_tokens"] <= spec["drafted_tokens"] <= 4 * spec["steps"]  # the output loops
    assert main(["bench", *argv]) == 0
    out = capsys.readouterr().out
    assert "rewrite: batch-1 greedy decode of 2" in out and "output = plain" in out
    rate = spec["acceptance_rate"]
    assert (f"bestiary engine + ngram k=4, rewrite: accepted {spec['accepted_tokens']} of "
            f"{spec['drafted_tokens']} draft tokens ({rate:.0%})") in out


def test_rewrite_output_check_can_fail(chat_engine, capsys, monkeypatch):
    """A speculative row whose output is not the plain row's is reported (JSON, red line) and the
    bench exits 1; first_difference names the text and token."""
    from bestiary.core.bench import systems
    from bestiary.core.bench.rewrite import first_difference
    from bestiary.core.cli.main import main

    assert first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 4, 5]]) is None
    assert first_difference([[1, 2], [3, 9, 5]], [[1, 2], [3, 4, 5]]) == "text 1, token 1"
    assert first_difference([[1, 2]], [[1, 2, 7]]) == "text 0, token 2"
    complete = systems.EngineSystem.complete

    def off_by_one(self, prompt, n):  # a speculative engine that gets its last token wrong
        timed, ids = complete(self, prompt, n)
        return timed, ids[:-1] + [ids[-1] + 1] if self.llm.executor.speculator and n > 1 else ids

    monkeypatch.setattr(systems.EngineSystem, "complete", off_by_one)
    argv = ["bench", "--engine_dir", str(chat_engine), *REWRITE, "--repeats", "1", "--new_tokens", "4",
            "--speculative", "ngram", "--json"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    fast = json.loads(captured.out)["rows"][1]["rewrite"]
    assert fast["output_equals_plain"] is False and fast["first_difference"] == "text 0, token 4"
    # adaptive k (the default): the label says k is at most --num_draft_tokens
    assert "bestiary engine + ngram k<=4: rewrite output differs from bestiary engine at text 0, token 4" in captured.err


def test_rewrite_needs_a_tokenizer(tiny, capsys):
    """The tiny engine has no tokenizer: one line naming the flag and the engine, exit 2."""
    engine = tiny / "engine"
    one_line(capsys, ["bench", "--engine_dir", str(engine), *REWRITE], 2,
             f"--workloads rewrite: engine {engine} has no tokenizer")


@pytest.mark.parametrize(("flags", "words"), [
    (["--compare", "vllm"], ["--compare vllm", "'vllm' is not a peer"]),
    (["--mixed_prompt_lens", "9", "3"], ["bench flags", "mixed_prompt_lens"]),
    (["--reference", "fastllm"], ["--reference fastllm", "expected engine or a --compare peer"]),
])
def test_user_errors_are_one_line(tiny, capsys, flags, words):
    one_line(capsys, ["bench", "--engine_dir", str(tiny / "engine"), "--workloads", "decode", *SMALL[:4], *flags],
             2, *words)


def test_not_an_engine_dir(tmp_path, capsys):
    one_line(capsys, ["bench", "--engine_dir", str(tmp_path)], 2, f"--engine_dir {tmp_path}", "no config.json")


@pytest.mark.slow
def test_dense_hf_dir_is_the_ggufs_own_dequantization(smollm2_gguf, hf_model, tmp_path, monkeypatch):
    """The dense baseline computes what transformers computes on the GGUF itself (it dequantizes per
    matmul); made once into the cache; the untied copy for FastLLM holds lm_head = the embedding."""
    import torch
    import transformers
    from safetensors import safe_open

    from bestiary.core.bench.dense_hf import dense_hf_dir

    monkeypatch.setenv("BESTIARY_CACHE", str(tmp_path))
    dense = dense_hf_dir(smollm2_gguf)
    stamp = (dense / "model.safetensors").stat().st_mtime_ns
    assert dense_hf_dir(smollm2_gguf) == dense and (dense / "model.safetensors").stat().st_mtime_ns == stamp
    ids = torch.tensor([[1, 504, 3458, 314, 5549, 30]])
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    ref = hf_model  # transformers on the GGUF itself, fp32 (tests/conftest.py, loaded once per session)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
    untied = dense_hf_dir(smollm2_gguf, torch.float16, untied=True)
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(untied / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
        assert f.get_tensor("lm_head.weight").dtype == torch.float16


def test_what_systems_print_does_not_reach_stdout(tiny, capfd, monkeypatch):
    """ftllm prints its loading to file descriptor 1: --json output must stay parseable."""
    import os

    from bestiary.core.bench import systems
    from bestiary.core.cli.main import main

    opened = systems.EngineSystem.__init__

    def noisy(self, *args, **kwargs):
        os.write(1, b"Load 0 Load 1\n")  # as a C library would, below sys.stdout
        opened(self, *args, **kwargs)

    monkeypatch.setattr(systems.EngineSystem, "__init__", noisy)
    assert main(["bench", "--engine_dir", str(tiny / "engine"), "--workloads", "decode", *SMALL, "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["rows"][0]["decode_tokens_per_second"] > 0
    assert "Load 0 Load 1" in err


def test_ratio_header_names_the_reference_without_its_build_notes():
    """A llama.cpp reference row's label carries its CPU features in brackets; the ratio column's header
    keeps the name only (the features made it ~190 characters wide)."""
    from bestiary.core.bench.run import Row
    from bestiary.core.cli.bench_tables import vs_column

    llama = Row(name="llama.cpp",
                label="llama.cpp SmolLM2-135M-Instruct.Q4_1.gguf [CPU : AVX2, AVX512, AVX512_BF16]")
    assert vs_column(llama) == "vs llama.cpp SmolLM2-135M-Instruct.Q4_1.gguf"
    hf = Row(name="hf", label="transformers 5.2 bfloat16 (dense)")
    assert vs_column(hf) == "vs transformers 5.2 bfloat16 (dense)"
    assert vs_column(None) == "vs -"
