"""The `bestiary` command line: convert, build, run, chat, serve, eval, inspect, list, cache, demo.

User mistakes (BestiaryError) print one line `error: ...` on stderr and exit with code 2,
environment faults (read-only or full disk, memory) with code 1 (core.cli.failures has the
table); bad flags are argparse errors (also exit code 2). Heavy modules load inside commands.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    """Register a `bestiary NAME` handler (its parser is added in `make_parser`)."""

    def wrap(fn):
        COMMANDS[name] = fn
        return fn

    return wrap


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def add_model_flags(parser: argparse.ArgumentParser, model) -> None:
    """One --flag per field of a pydantic model (the schema is the single source of the options); an
    int field is a positive_int flag, or a non_negative_int one where the field allows 0 (ge=0)."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        kind = args[0] if args[0] in (int, float, str) else str
        if kind is int:
            kind = non_negative_int if any(getattr(m, "ge", None) == 0 for m in field.metadata) else positive_int
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help=f"{field.description or ''} (default: {field.default})")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_output_len", type=positive_int, default=64, help="New tokens per input.")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    parser.add_argument("--top_k", type=int, default=0, help="0 = off.")
    parser.add_argument("--top_p", type=float, default=1.0, help="1.0 = off.")
    parser.add_argument("--random_seed", type=int, default=None)
    g = parser.add_argument_group("penalties, stopping and beam search (docs/sampling.md)")
    g.add_argument("--num_beams", type=positive_int, default=None, help="Beam search width (1 = off).")
    g.add_argument("--length_penalty", type=float, default=None, help="Beam score = cum log prob / len ** this (1.0).")
    g.add_argument("--early_stopping", choices=["true", "false", "never"], default=None,
                   help="Beam search end rule (false = HF's heuristic, the default).")
    g.add_argument("--beam_search_diversity_rate", type=float, default=None, help="Rank penalty within a beam (0).")
    g.add_argument("--repetition_penalty", type=float, default=None, help="Over prompt + output; 1.0 = off.")
    g.add_argument("--presence_penalty", type=float, default=None, help="Over the output; 0 = off.")
    g.add_argument("--frequency_penalty", type=float, default=None, help="Per occurrence in the output; 0 = off.")
    g.add_argument("--min_length", type=int, default=None, help="Generated tokens before an end id may be chosen.")
    g.add_argument("--top_p_decay", type=float, default=None, help="top_p *= this after each token (1.0 = off).")
    g.add_argument("--top_p_min", type=float, default=None, help="Lower bound of the decayed top_p.")
    g.add_argument("--top_p_reset_ids", type=int, default=None, help="This id resets the decayed top_p.")
    g.add_argument("--stop_words", nargs="+", default=None, metavar="WORD",
                   help="Text (or comma-separated ids like 13,198) that ends generation.")
    g.add_argument("--bad_words", nargs="+", default=None, metavar="WORD",
                   help="Text (or comma-separated ids) never generated.")
    g.add_argument("--end_id", type=int, default=None, help="Stop token (default: the tokenizer's).")
    g.add_argument("--ignore_eos", action="store_true", help="Generate until --max_output_len.")
    g.add_argument("--output_log_probs", action="store_true",
                   help="After each output, print a JSON line with log probs (and beams).")
    w = parser.add_argument_group("attention window (docs/attention-window.md)")
    w.add_argument("--max_attention_window", type=positive_int, default=None,
                   help="Attend to at most this many recent keys, sinks included (default: the engine's; at most that).")
    w.add_argument("--sink_token_length", type=non_negative_int, default=None,
                   help="First tokens every windowed query keeps attending to (default: the engine's; 0 = none).")


def add_quant_flags(parser: argparse.ArgumentParser) -> None:
    """convert's quantization flags (docs/quantization.md; checked in core.quant.options)."""
    q = parser.add_argument_group("quantization")
    q.add_argument("--use_weight_only", action="store_true", help="Weight-only quantization of the linears.")
    q.add_argument("--weight_only_precision", default=None, choices=["int8", "int4"],
                   help="int8 per output channel (W8A16, default) or int4 group-wise (W4A16).")
    q.add_argument("--group_size", type=positive_int, default=None,
                   help="int4 group size (weight-only int4, --w4a8_awq): 32, 64 or 128 (default 128).")
    q.add_argument("--has_zero_point", action="store_true", help="int4 with per-group zero points.")
    q.add_argument("--exclude_modules", nargs="+", default=None, metavar="NAME",
                   help="Module names or globs left unquantized, e.g. lm_head mlp.proj.")
    q.add_argument("--int8_kv_cache", action="store_true", help="INT8 KV cache with per-layer scales.")
    q.add_argument("--fp8_kv_cache", action="store_true", help="FP8 (e4m3) KV cache with per-layer scales.")
    q.add_argument("--fp8", action="store_true",
                   help="FP8: e4m3 weights and activations, per-tensor scales (calibrated).")
    q.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                   help="W8A8_SQ_PER_CHANNEL: SmoothQuant with migration strength 0 < ALPHA <= 1 (e.g. 0.5), "
                        "int8 weights and activations.")
    q.add_argument("--w4a8_awq", action="store_true",
                   help="W4A8_AWQ: int4 group-wise weights with AWQ scales, FP8 activations.")
    q.add_argument("--weight_quantizer", default=None, choices=["rtn", "gptq"],
                   help="How weights are rounded: rtn (round to nearest) or gptq (calibrated error "
                        "compensation, int4 only). Default: gptq for weight-only int4, else rtn.")
    q.add_argument("--tune_steps", type=int, default=None, metavar="N",
                   help="int4 GPTQ: steps of end-to-end scale tuning towards the float model's outputs "
                        "on the calibration text (0 = none; default: a short tuning).")
    q.add_argument("--calib_text", default=None, metavar="FILE",
                   help="Text file for calibration (KV cache and activation scales); default: a short built-in text.")


def make_parser() -> argparse.ArgumentParser:
    from bestiary import __version__
    from bestiary.core.cli.speculative_flags import add_speculative_flags
    from bestiary.core.format.build_config import BuildConfig

    parser = argparse.ArgumentParser(prog="bestiary", description="Plugin-based LLM model zoo and inference engine.")
    parser.add_argument("--version", action="version", version=f"bestiary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("convert", help="HF dir / .safetensors / .bin / .pth / .gguf / .flm -> checkpoint dir")
    p.add_argument("--model_dir", default=None,
                   help="HF model directory or a .gguf/.flm/.safetensors file (with --lora_dir of TensorRT-LLM LoRA tensors: "
                        "the base model's checkpoint or engine dir).")
    p.add_argument("--output_dir", default=None, help="The checkpoint directory (not needed with --dry_run).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--tp_size", type=positive_int, default=1)
    p.add_argument("--pp_size", type=positive_int, default=1)
    p.add_argument("--moe_tp_size", type=positive_int, default=None,
                   help="MoE models: ranks each expert's FFN dim is split over (default --tp_size / --moe_ep_size).")
    p.add_argument("--moe_ep_size", type=positive_int, default=None,
                   help="MoE models: ranks the experts are spread over, whole experts each (expert parallelism; "
                        "--moe_tp_size * --moe_ep_size = --tp_size; default 1).")
    p.add_argument("--use_parallel_embedding", action="store_true",
                   help="Split the token embedding over the tp ranks instead of replicating it.")
    p.add_argument("--embedding_sharding_dim", type=int, default=0, choices=[0, 1],
                   help="With --use_parallel_embedding: 0 splits the vocabulary, 1 the hidden dim.")
    p.add_argument("--architecture", default=None, help="Force a registered architecture (see `bestiary list`).")
    p.add_argument("--allow_nonfinite", action="store_true",
                   help="Accept weights with NaN or inf values (refused by default, naming the tensor).")
    p.add_argument("--dry_run", action="store_true",
                   help="Write nothing: list each target tensor's sources, postprocess hook and TP slice, and flag "
                        "missing, unused, mis-shaped and (against an HF reference) transposed tensors; exit 1 if any.")
    p.add_argument("--report", default=None, metavar="FILE.json", help="With --dry_run: also write the findings as JSON.")
    lora = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--lora_dir", default=None, metavar="DIR",
                      help="Convert an adapter instead of a model: an HF PEFT dir -> TensorRT-LLM's LoRA tensors "
                           "(model.lora_weights.npy, model.lora_config.npy), or such a dir -> a PEFT dir.")
    lora.add_argument("--storage_type", default="float16", choices=["float32", "float16"],
                      help="dtype of the written LoRA weights tensor.")
    add_quant_flags(p)

    p = sub.add_parser("build", help="checkpoint dir -> engine dir")
    p.add_argument("--checkpoint_dir", required=True)
    p.add_argument("--output_dir", required=True)
    add_model_flags(p, BuildConfig)
    p.add_argument("--skip_memory_check", action="store_true",
                   help="Build limits whose KV cache exceeds this host's RAM (for a larger target host).")
    lora = p.add_argument_group("LoRA adapters bundled in the engine (docs/lora.md)")
    lora.add_argument("--lora_dir", nargs="+", default=None, metavar="DIR",
                      help="HF PEFT adapter dirs; the i-th is task uid i (`bestiary run --lora_task_uids`).")
    lora.add_argument("--max_lora_rank", type=positive_int, default=None,
                      help="Refuse an adapter with a larger rank (default: the largest given).")
    lora.add_argument("--lora_target_modules", nargs="+", default=None, metavar="MODULE",
                      help="LoRA module names adapters may adapt (attn_q, attn_k, ...; default: all the model takes).")

    p = sub.add_parser("export", help="checkpoint or engine dir -> FastLLM .flm file (docs/fastllm.md)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="The engine directory to export.")
    src.add_argument("--checkpoint_dir", help="The checkpoint directory to export.")
    p.add_argument("--format", default="flm", choices=["flm"], help="Output format: FastLLM's .flm (version 2).")
    p.add_argument("--output_file", required=True, help="The .flm file to write (an existing .flm is replaced).")
    p.add_argument("--flm_dtype", default=None, metavar="DTYPE",
                   help="Linear weights as float32, float16, int8, int4 (per row) or int4g128 (groups of 128); "
                        "default: the model's own layout.")

    p = sub.add_parser("run", help="generate text from an engine")
    p.add_argument("--engine_dir", required=True)
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input_text", nargs="+", help="One or more prompts.")
    inputs.add_argument("--input_ids", nargs="+", help="Comma-separated token ids, one group per input.")
    add_sampling_flags(p)
    p.add_argument("--streaming", action="store_true", help="Print tokens as they are generated.")
    p.add_argument("--chat", action="store_true", help="Wrap each input in the model's chat template.")
    p.add_argument("--output_ids", action="store_true", help="Print generated ids instead of text.")
    p.add_argument("--num_threads", type=positive_int, default=None, help="torch CPU threads.")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a tp > 1 engine: rank r on N + r).")
    p.add_argument("--allow_nonfinite", action="store_true",
                   help="Accept weights with NaN or inf values (refused by default, naming the tensor).")
    p.add_argument("--lora_dir", nargs="+", default=None, metavar="DIR",
                   help="HF PEFT LoRA adapter directories; task uid i is the i-th directory.")
    p.add_argument("--lora_task_uids", nargs="+", default=None, metavar="UID",
                   help="One per input: the index of its --lora_dir adapter, or -1 for the base model.")
    add_speculative_flags(p)

    p = sub.add_parser("eval", help="perplexity of an engine on a text file")
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--text_file", required=True)
    p.add_argument("--max_tokens", type=positive_int, default=None, help="Evaluate at most this many tokens.")
    p.add_argument("--num_threads", type=positive_int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a tp > 1 engine: rank r on N + r).")
    p.add_argument("--allow_nonfinite", action="store_true",
                   help="Accept weights with NaN or inf values (refused by default, naming the tensor).")

    p = sub.add_parser("inspect", help="config, tensor table, dtype and size of a checkpoint/engine dir")
    p.add_argument("directory")

    sub.add_parser("list", help="registered architectures")

    p = sub.add_parser("cache", help="list or clear the cache (LLM(source) conversions, demo, CPU kernels)")
    p.add_argument("action", choices=["list", "clear"])

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for an engine (docs/serving.md)")
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (127.0.0.1: this host only).")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api_key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/*.")
    p.add_argument("--served_model_name", default=None, help="Model id of the API (default: the engine dir's name).")
    p.add_argument("--max_queue_len", type=positive_int, default=1024,
                   help="Requests that may wait for their first token; more are answered 503.")
    p.add_argument("--chat_template", default=None, metavar="FILE",
                   help="Jinja2 chat template replacing the model's (or a tokenizer_config.json with one).")
    p.add_argument("--lora_modules", nargs="+", default=None, metavar="NAME=DIR",
                   help="HF PEFT LoRA adapters served as model names (loaded at start).")
    p.add_argument("--num_threads", type=positive_int, default=None, help="torch CPU threads.")
    p.add_argument("--log_level", default="warning", choices=["debug", "info", "warning", "error"])
    add_speculative_flags(p)

    p = sub.add_parser("chat", help="chat with an engine in the terminal (or one answer per line from a pipe)")
    p.add_argument("--engine_dir", required=True, help="An engine or checkpoint directory (or any source run takes).")
    p.add_argument("--system", default=None, metavar="TEXT", help="The system prompt (/system TEXT changes it).")
    p.add_argument("--max_output_len", type=positive_int, default=256, help="New tokens per answer at most.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    p.add_argument("--top_k", type=int, default=0, help="0 = off.")
    p.add_argument("--top_p", type=float, default=1.0, help="1.0 = off.")
    p.add_argument("--random_seed", type=int, default=None)
    p.add_argument("--num_threads", type=positive_int, default=None, help="torch CPU threads.")

    p = sub.add_parser("demo", help="convert, build and chat with the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max_output_len", type=positive_int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--workdir", default=None, help="Where to put the checkpoint and engine (default: a cache dir).")
    p.add_argument("--num_threads", type=positive_int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a tp > 1 engine: rank r on N + r).")

    from bestiary.core.cli.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `bestiary` script: every failure is one line and an exit code (cli.failures)."""
    args = make_parser().parse_args(argv)
    from bestiary.core.cli import (  # noqa: F401 - register the handlers into COMMANDS
        bench,  # noqa: F401 - registers `bestiary bench`
        chat,
        commands,
        serve,
    )
    from bestiary.core.cli.failures import check_text_args, exit_code_for, signals_as_interrupts

    with signals_as_interrupts():
        try:
            check_text_args(args)
            return COMMANDS[args.command](args) or 0
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the one error path
            return exit_code_for(err)
