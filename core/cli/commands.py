"""Handlers of the `bestiary` subcommands and, before each, the function adding its parser (both
registered into cli.COMMANDS on import)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from bestiary.core.cli.guided_flags import add_guided_flags
from bestiary.core.cli.main import (
    THREADS_HELP,
    add_model_flags,
    add_quant_flags,
    add_sampling_flags,
    command,
)
from bestiary.core.cli.model_arg import add_model_args, model_label, resolve_model
from bestiary.core.cli.parsing import path_arg, positive_int, thread_count
from bestiary.core.cli.speculative_flags import add_speculative_flags
from bestiary.core.format import stream_line
from bestiary.core.format.config import read_text_file
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.cli.main import SubParsers
    from bestiary.core.lora.request import LoraRequest
    from bestiary.core.runtime.guided import GuidedConfig
    from bestiary.core.runtime.sampling import SamplingConfig

ERR = Console(stderr=True)
NONFINITE_HELP = "Accept weights with NaN or inf values (refused by default, naming the tensor)."
DEVICE_HELP = "cpu, cuda or cuda:N (a tp > 1 engine: rank r on N + r)."
# convert's two required flags depend on the mode (--dry_run, --lora_dir), so argparse cannot require them:
# its usage shows each mode with what that mode requires, unbracketed.
CONVERT_USAGE = ("%(prog)s --model_dir SOURCE --output_dir DIR [options]\n"
                 "       %(prog)s --model_dir SOURCE --dry_run [--report FILE.json] [options]\n"
                 "       %(prog)s --lora_dir DIR --output_dir DIR [--model_dir BASE] [--storage_type {float32,float16}]")


def stdout_console() -> Console:
    """Console for tables on stdout; wide when piped, so names are never cut."""
    return Console() if sys.stdout.isatty() else Console(width=240)


def add_convert_parser(sub: SubParsers) -> None:
    """`bestiary convert`'s flags: the source, layout and dtype, LoRA adapters, quantization."""
    p = sub.add_parser("convert", help="HF dir / .safetensors / .bin / .pth / .gguf / .flm -> checkpoint dir",
                       usage=CONVERT_USAGE)
    p.add_argument("--model_dir", type=path_arg, default=None,
                   help="Required: the source, an HF model directory or a .gguf/.flm/.safetensors/.bin/.pth file. "
                        "With --lora_dir optional: the base model's checkpoint or engine dir (TensorRT-LLM LoRA "
                        "tensors -> PEFT).")
    p.add_argument("--output_dir", type=path_arg, default=None,
                   help="Required: the checkpoint directory to write (not with --dry_run).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="dtype of the written weights; auto: the source config's torch_dtype, else float32.")
    p.add_argument("--tp_size", type=positive_int, default=1,
                   help="Tensor-parallel ranks: the weights are split into this many rank files.")
    p.add_argument("--pp_size", type=positive_int, default=1,
                   help="Pipeline-parallel stages: the layers are split over this many stages.")
    p.add_argument("--moe_tp_size", type=positive_int, default=None,
                   help="MoE models: ranks each expert's FFN dim is split over (default --tp_size / --moe_ep_size).")
    p.add_argument("--moe_ep_size", type=positive_int, default=None,
                   help="MoE models: ranks the experts are spread over, whole experts each (expert parallelism; "
                        "--moe_tp_size * --moe_ep_size = --tp_size; default 1).")
    p.add_argument("--use_parallel_embedding", action="store_true",
                   help="Split the token embedding over the tp ranks instead of replicating it.")
    p.add_argument("--embedding_sharding_dim", type=int, default=0, choices=[0, 1],
                   help="With --use_parallel_embedding: 0 splits the vocabulary, 1 the hidden dim.")
    p.add_argument("--architecture", default=None,
                   help="Force a registered architecture (see `bestiary list`; default: detected from the source).")
    p.add_argument("--allow_nonfinite", action="store_true", help=NONFINITE_HELP)
    p.add_argument("--dry_run", action="store_true",
                   help="Write nothing: list each target tensor's sources, postprocess hook and TP slice, and flag "
                        "missing, unused, mis-shaped and (against an HF reference) transposed tensors; exit 1 if any.")
    p.add_argument("--report", type=path_arg, default=None, metavar="FILE.json",
                   help="With --dry_run: also write the findings as JSON.")
    lora = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--lora_dir", type=path_arg, default=None, metavar="DIR",
                      help="Convert an adapter instead of a model: an HF PEFT dir -> TensorRT-LLM's LoRA tensors "
                           "(model.lora_weights.npy, model.lora_config.npy), or such a dir -> a PEFT dir.")
    lora.add_argument("--storage_type", default="float16", choices=["float32", "float16"],
                      help="dtype of the written LoRA weights tensor.")
    add_quant_flags(p)


@command("convert", add_convert_parser)
def cmd_convert(args: argparse.Namespace) -> int:
    if args.lora_dir:
        return convert_lora_dir(args)
    if not args.model_dir:
        raise BestiaryError("--model_dir: required (or --lora_dir to convert a LoRA adapter)")
    if args.dry_run:
        return convert_dry_run(args)
    if args.report:
        raise BestiaryError("--report: only with --dry_run")
    if not args.output_dir:
        raise BestiaryError("--output_dir: required (unless --dry_run)")
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.quant.options import QuantFlags, quant_config_from_flags

    flags = QuantFlags(**{f: getattr(args, f) for f in QuantFlags.__dataclass_fields__})
    options = ConvertOptions(dtype=args.dtype, tp_size=args.tp_size, pp_size=args.pp_size,
                             architecture=args.architecture,
                             quantization=quant_config_from_flags(flags) if flags.any() else None,
                             calib_text=args.calib_text, smoothquant_alpha=args.smoothquant,
                             weight_quantizer=args.weight_quantizer, tune_steps=args.tune_steps,
                             allow_nonfinite=args.allow_nonfinite, use_parallel_embedding=args.use_parallel_embedding,
                             embedding_sharding_dim=args.embedding_sharding_dim, moe_tp_size=args.moe_tp_size,
                             moe_ep_size=args.moe_ep_size)
    out = convert(args.model_dir, args.output_dir, options, show_progress=sys.stderr.isatty())
    ERR.print(f"checkpoint written to {out}")
    return 0


def convert_lora_dir(args: argparse.Namespace) -> int:
    """`convert --lora_dir`: PEFT dir <-> TensorRT-LLM's LoRA tensors (core.convert.lora_convert)."""
    from bestiary.core.convert.lora_convert import convert_lora

    if not args.output_dir:
        raise BestiaryError("--output_dir: required with --lora_dir")
    if args.dry_run:
        raise BestiaryError("--dry_run: not with --lora_dir")
    out = convert_lora(args.lora_dir, args.output_dir, args.storage_type, args.architecture, args.model_dir)
    ERR.print(f"LoRA adapter written to {out}")
    return 0


def convert_dry_run(args: argparse.Namespace) -> int:
    """`convert --dry_run`: the linter's table on stdout, findings on stderr; 1 when anything is flagged."""
    from bestiary.core.convert.lint import lint

    report = lint(args.model_dir, tp_size=args.tp_size, pp_size=args.pp_size, architecture=args.architecture,
                  moe_tp_size=args.moe_tp_size, moe_ep_size=args.moe_ep_size)
    table = Table(title=f"{report.source} -> {report.architecture} (tp {report.tp_size}, pp {report.pp_size}): dry run")
    for col in ("rank", "target", "shape", "source tensor(s)", "postprocess", "TP slice"):
        table.add_column(col)
    for row in report.tensors:
        table.add_row(str(row.rank), row.target, str(row.shape), "\n".join(row.sources),
                      row.postprocess.rpartition(".")[2], row.tp_slice)
    stdout_console().print(table)
    for note in report.notes:
        ERR.print(f"note: {note}", markup=False, highlight=False)
    if args.report:
        from bestiary.core.format.checkpoint import write_json

        write_json(Path(args.report), report.to_json())
    problems = report.problems()
    for line in problems:
        ERR.print(f"[red]flag:[/red] {line}", highlight=False)
    ERR.print(f"{len(problems)} finding(s); nothing written" if problems else "no findings; nothing written")
    return 1 if problems else 0


def add_build_parser(sub: SubParsers) -> None:
    """`bestiary build`'s flags: BuildConfig's fields, the memory check, bundled LoRA adapters."""
    from bestiary.core.format.build_config import BuildConfig

    p = sub.add_parser("build", help="checkpoint dir -> engine dir")
    p.add_argument("--checkpoint_dir", type=path_arg, required=True, help="A checkpoint written by `bestiary convert`.")
    p.add_argument("--output_dir", type=path_arg, required=True,
                   help="The engine directory to write (new, empty or an earlier engine, replaced atomically).")
    add_model_flags(p, BuildConfig)
    p.add_argument("--skip_memory_check", action="store_true",
                   help="Build limits whose KV cache exceeds this host's RAM (for a larger target host).")
    lora = p.add_argument_group("LoRA adapters bundled in the engine (docs/lora.md)")
    lora.add_argument("--lora_dir", nargs="+", type=path_arg, default=None, metavar="DIR",
                      help="HF PEFT adapter dirs; the i-th is task uid i (`bestiary run --lora_task_uids`).")
    lora.add_argument("--max_lora_rank", type=positive_int, default=None,
                      help="Refuse an adapter with a larger rank (default: the largest given).")
    lora.add_argument("--lora_target_modules", nargs="+", default=None, metavar="MODULE",
                      help="LoRA module names adapters may adapt (attn_q, attn_k, ...; default: all the model takes).")


@command("build", add_build_parser)
def cmd_build(args: argparse.Namespace) -> int:
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.format.config import validate_config

    flags = {k: getattr(args, k) for k in BuildConfig.model_fields if getattr(args, k) is not None}
    build = validate_config(BuildConfig, flags, "build flags")
    out = build_engine(args.checkpoint_dir, args.output_dir, build, check_memory=not args.skip_memory_check,
                       lora_dirs=args.lora_dir, max_lora_rank=args.max_lora_rank,
                       lora_target_modules=args.lora_target_modules)
    ERR.print(f"engine written to {out}")
    return 0


def add_export_parser(sub: SubParsers) -> None:
    """`bestiary export`'s flags: the engine or checkpoint dir, the .flm file and its dtype."""
    p = sub.add_parser("export", help="checkpoint or engine dir -> FastLLM .flm file (docs/fastllm.md)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", type=path_arg, help="The engine directory to export.")
    src.add_argument("--checkpoint_dir", type=path_arg, help="The checkpoint directory to export.")
    p.add_argument("--format", default="flm", choices=["flm"], help="Output format: FastLLM's .flm (version 2).")
    p.add_argument("--output_file", type=path_arg, required=True,
                   help="The .flm file to write (an existing .flm is replaced).")
    p.add_argument("--flm_dtype", default=None, metavar="DTYPE",
                   help="Linear weights as float32, float16, int8, int4 (per row) or int4g128 (groups of 128); "
                        "default: the model's own layout.")


@command("export", add_export_parser)
def cmd_export(args: argparse.Namespace) -> int:
    from bestiary.core.convert.export_flm import export_flm

    out = export_flm(args.engine_dir or args.checkpoint_dir, args.output_file, args.flm_dtype,
                     show_progress=sys.stderr.isatty())
    ERR.print(f"{args.format} file written to {out}")
    return 0


def _sampling(args: argparse.Namespace, guided: GuidedConfig | None = None) -> SamplingConfig:
    """The SamplingConfig of `bestiary run`'s sampling flags and `guided` (the structured output flags: a bad
    value: a one-line error naming the flag)."""
    from bestiary.core.format.config import validate_config
    from bestiary.core.runtime.sampling import SamplingConfig

    same = ("temperature", "top_k", "top_p", "random_seed", "length_penalty", "beam_search_diversity_rate",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "min_length", "top_p_decay", "top_p_min",
            "top_p_reset_ids", "end_id", "ignore_eos", "output_log_probs", "max_attention_window",
            "sink_token_length")
    fields = {name: getattr(args, name) for name in same}
    fields.update(max_new_tokens=args.max_output_len, beam_width=args.num_beams)
    if args.early_stopping is not None:
        fields["early_stopping"] = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    for name in ("stop_words", "bad_words"):
        if getattr(args, name):
            fields[name] = [_word(w) for w in getattr(args, name)]
    fields = {k: v for k, v in fields.items() if v is not None}
    if guided is not None:
        fields["guided"] = guided
    return validate_config(SamplingConfig, fields, "sampling flags")


def _word(text: str) -> str | list[int]:
    """A --stop_words/--bad_words value: comma-separated integers are ids, anything else text."""
    parts = text.split(",")
    return [int(p) for p in parts] if all(p.strip().isdigit() for p in parts) else text


def _parse_ids(groups: list[str]) -> list[list[int]]:
    try:
        return [[int(t) for t in g.replace(",", " ").split()] for g in groups]
    except ValueError:
        raise BestiaryError(f"--input_ids {' '.join(groups)!r}: expected comma-separated integers") from None


def add_run_parser(sub: SubParsers) -> None:
    """`bestiary run`'s flags: the engine, the inputs, sampling, output, LoRA and speculative decoding."""
    p = sub.add_parser("run", help="generate text from a model: an engine dir or any source (converted once, cached)")
    add_model_args(p)
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--input_text", nargs="+",
                        help="One or more prompts; one output line each (a newline in an answer is written \\n, "
                             "a backslash \\\\).")
    inputs.add_argument("--input_ids", nargs="+", help="Comma-separated token ids, one group per input.")
    add_sampling_flags(p)
    p.add_argument("--streaming", action="store_true", help="Print tokens as they are generated.")
    p.add_argument("--chat", action="store_true", help="Wrap each input in the model's chat template.")
    p.add_argument("--output_ids", action="store_true", help="Print generated ids instead of text.")
    p.add_argument("--num_threads", type=thread_count, default=None, help=THREADS_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--allow_nonfinite", action="store_true", help=NONFINITE_HELP)
    p.add_argument("--lora_dir", nargs="+", type=path_arg, default=None, metavar="DIR",
                   help="HF PEFT LoRA adapter directories; task uid i is the i-th directory (default: none).")
    p.add_argument("--lora_task_uids", nargs="+", default=None, metavar="UID",
                   help="One per input: the index of its --lora_dir adapter, or -1 for the base model "
                        "(default: the one --lora_dir adapter for every input, else the base model).")
    add_guided_flags(p)
    add_speculative_flags(p)


@command("run", add_run_parser)
def cmd_run(args: argparse.Namespace) -> int:
    from bestiary.core.cli.guided_flags import check_guided, guided_from_args
    from bestiary.core.cli.speculative_flags import speculative_from_args
    from bestiary.core.runtime.llm import LLM

    guided, guided_flag = guided_from_args(args)  # a missing or unreadable file: before the engine loads
    sampling = _sampling(args, guided)
    if args.streaming and args.output_log_probs:
        raise BestiaryError("--streaming --output_log_probs: streaming prints text only; "
                            "drop --streaming to get the log probs")
    speculative = speculative_from_args(args)
    llm = LLM(resolve_model(args), num_threads=args.num_threads, allow_nonfinite=args.allow_nonfinite,
              device=args.device, speculative=speculative)
    check_guided(llm, guided, guided_flag)  # a schema, regex or grammar the compiler refuses names its flag
    note = _length_cap_note(args.max_output_len, llm.engine.build.max_seq_len)  # said after the outputs
    prompts: list = _parse_ids(args.input_ids) if args.input_ids else list(args.input_text)
    if llm.tokenizer is None and not args.input_ids:
        raise BestiaryError(f"{model_label(args)}: engine has no tokenizer; use --input_ids")
    as_ids = args.output_ids or llm.tokenizer is None
    adapters = _lora_requests(args.lora_dir, args.lora_task_uids, len(prompts), sorted(llm.lora_store.bundled, key=int))
    if args.streaming:
        for prompt, lora in zip(prompts, adapters):
            for piece in llm.generate_stream(prompt, sampling, chat=args.chat, lora=lora):  # error lines: a fresh line
                stream_line.write(f"{piece} " if as_ids and isinstance(piece, int) else one_line(str(piece)))
            stream_line.write("\n")
            _say(note)
            note = None
            _print_stats(llm.last_stats, sampling.beam_width)
        return 0
    completions = llm.generate(prompts, sampling, chat=args.chat, lora=adapters)
    for c in completions:
        print(" ".join(map(str, c.output_ids)) if as_ids else one_line(c.text or ""))
        if args.output_log_probs:
            print(json.dumps(_log_prob_record(c)))
    _say(note)
    _print_stats(llm.last_stats, sampling.beam_width)
    for i, c in enumerate(completions):
        if c.speculative is not None:
            print(f"[bestiary] input {i}: {args.speculative} {c.speculative.summary()}", file=sys.stderr)
    return 0


def _lora_requests(dirs: list[str] | None, uids: list[str] | None, count: int,
                   bundled: Sequence[str] = ()) -> list[LoraRequest | None]:
    """--lora_dir / --lora_task_uids -> one LoraRequest (or None: -1, the base model) per input; without
    --lora_dir, the uids pick the engine's bundled adapters (`bundled`: their task uids)."""
    from bestiary.core.lora.request import LoraRequest

    if uids is not None and not dirs and bundled:
        return _bundled_requests(uids, count, bundled)
    if uids is None:
        if dirs and len(dirs) > 1:
            raise BestiaryError(f"--lora_dir gives {len(dirs)} adapters: say which input uses which with "
                                "--lora_task_uids (one per input, -1: the base model)")
        return [LoraRequest(Path(dirs[0]).name, dirs[0]) if dirs else None] * count
    if not dirs:
        raise BestiaryError("--lora_task_uids needs --lora_dir (or an engine built with --lora_dir)")
    if len(uids) != count:
        raise BestiaryError(f"--lora_task_uids has {len(uids)} values for {count} inputs; give one per input")
    out: list[LoraRequest | None] = []
    for uid in uids:
        try:
            i = int(uid)
        except ValueError:
            raise BestiaryError(f"--lora_task_uids: {uid!r} is not an integer") from None
        if not -1 <= i < len(dirs):
            raise BestiaryError(f"--lora_task_uids: {i} is not -1 or an index of the {len(dirs)} --lora_dir adapters")
        out.append(None if i < 0 else LoraRequest(f"{i}:{Path(dirs[i]).name}", dirs[i]))
    return out


def _bundled_requests(uids: list[str], count: int, bundled: Sequence[str]) -> list[LoraRequest | None]:
    """--lora_task_uids of an engine's bundled adapters -> LoraRequest(uid) or None (-1) per input."""
    from bestiary.core.lora.request import LoraRequest

    if len(uids) != count:
        raise BestiaryError(f"--lora_task_uids has {len(uids)} values for {count} inputs; give one per input")
    for uid in uids:
        if uid != "-1" and uid not in bundled:
            raise BestiaryError(f"--lora_task_uids: {uid!r} is not -1 or a task uid of the engine's adapters "
                                f"({', '.join(bundled)})")
    return [None if uid == "-1" else LoraRequest(uid) for uid in uids]


def _log_prob_record(c) -> dict:
    """--output_log_probs: the output's log probs, and every beam's ids and score for beam search."""
    record = {"cum_log_prob": c.cum_log_prob, "log_probs": c.log_probs, "finish_reason": c.finish_reason}
    if c.beams:
        record["beams"] = [{"output_ids": b.output_ids, "score": b.score, "cum_log_prob": b.cum_log_prob}
                           for b in c.beams]
    return record


def _length_cap_note(max_output_len: int, max_seq_len: int | None) -> str | None:
    """The note when --max_output_len is more than the engine can give (it used to run for minutes
    silently); max_seq_len None (not set in the build config) caps nothing. cmd_run says it after the
    outputs, beside the statistics: a mistake found before them is then its one line on stderr."""
    if max_seq_len is not None and max_output_len >= max_seq_len:
        return (f"note: --max_output_len {max_output_len:,} is more than the engine allows: each output ends "
                f"at max_seq_len {max_seq_len} tokens (prompt + output)")
    return None


def one_line(text: str) -> str:
    r"""An answer as one line of `run`'s output, losslessly: a backslash is written \\, a newline \n, a carriage
    return \r. Read back left to right: re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m[1], m[1]), line)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _say(note: str | None) -> None:
    """Print `note` (if any) on stderr."""
    if note is not None:
        print(note, file=sys.stderr)


def _print_stats(stats, beam_width: int = 1) -> None:
    """The timing line on stderr. Beam search returns its tokens when it finishes, so it has no
    first-token time or decode rate (dividing by the time after the "first" token gave 1e6 tok/s)."""
    head = (f"[bestiary] {stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated in "
            f"{stats.seconds:.2f} s")
    if beam_width > 1:
        print(f"{head}: {stats.tokens_per_second:.1f} tokens/s (beam search, {beam_width} beams)", file=sys.stderr)
        return
    ttft = f"{stats.first_token_seconds * 1000:.0f} ms" if stats.first_token_seconds is not None else "-"
    print(f"{head}: {stats.tokens_per_second:.1f} tokens/s ({stats.decode_tokens_per_second:.1f} decode), "
          f"first token {ttft}", file=sys.stderr)


def add_eval_parser(sub: SubParsers) -> None:
    """`bestiary eval`'s flags: the engine, the text file and how much of it."""
    from bestiary.core.cli.summarize_command import add_summarize_flags

    p = sub.add_parser("eval", help="perplexity of an engine on a text file, or summaries scored against HF (ROUGE)")
    add_model_args(p)
    p.add_argument("--task", choices=["perplexity", "summarize"], default="perplexity",
                   help="perplexity of --text_file, or summarize --dataset (docs/evaluation.md).")
    p.add_argument("--text_file", type=path_arg, default=None,
                   help="UTF-8 text whose perplexity is measured (required by --task perplexity).")
    p.add_argument("--max_tokens", type=positive_int, default=None,
                   help="Evaluate at most this many tokens, the first ones (default: all).")
    p.add_argument("--num_threads", type=thread_count, default=None, help=THREADS_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--allow_nonfinite", action="store_true", help=NONFINITE_HELP)
    add_summarize_flags(p)


@command("eval", add_eval_parser)
def cmd_eval(args: argparse.Namespace) -> int:
    from bestiary.core.cli.summarize_command import run_summarize
    from bestiary.core.runtime.engine import load_engine
    from bestiary.core.runtime.evaluate import perplexity
    from bestiary.core.runtime.worker_group import check_device

    check_device(args.device)
    if args.task == "summarize":
        args.engine_dir, args.model = str(resolve_model(args)), None  # run_summarize loads --engine_dir
        return run_summarize(args)
    if args.text_file is None:
        raise BestiaryError("--task perplexity needs --text_file")
    text = read_text_file(args.text_file, "--text_file")
    label = model_label(args)
    engine = load_engine(resolve_model(args), device=args.device, allow_nonfinite=args.allow_nonfinite,
                         num_threads=args.num_threads)
    if engine.tokenizer is None:
        raise BestiaryError(f"{label}: engine has no tokenizer; eval needs one")
    ids = engine.tokenizer.encode(text)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    result = perplexity(engine, ids)
    print(json.dumps({"tokens": result.tokens, "nll": round(result.nll, 6), "perplexity": round(result.perplexity, 4)}))
    return 0


def add_inspect_parser(sub: SubParsers) -> None:
    """`bestiary inspect DIRECTORY`."""
    p = sub.add_parser("inspect", help="config, tensor table, dtype and size of a checkpoint/engine dir")
    p.add_argument("directory", type=path_arg, help="A checkpoint or engine directory.")


@command("inspect", add_inspect_parser)
def cmd_inspect(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from bestiary.core.format.config import config_sections, read_json

    directory = Path(args.directory)
    data = read_json(directory / "config.json")
    out = stdout_console()
    config, build = config_sections(data, str(directory / "config.json"))
    table = Table(title=f"{directory} ({'engine' if 'pretrained_config' in data else 'checkpoint'})")
    table.add_column("field")
    table.add_column("value")
    for key, value in config.items():
        table.add_row(key, json.dumps(value))
    for key, value in (build or {}).items():
        table.add_row(f"build.{key}", json.dumps(value))
    out.print(table)
    for rank_path in sorted(directory.glob("rank*.safetensors")):
        tensors = Table(title=rank_path.name)
        for col in ("tensor", "shape", "dtype", "MiB"):
            tensors.add_column(col, justify="right" if col == "MiB" else "left")
        total = 0
        try:
            with safe_open(str(rank_path), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    shape = part.get_shape()
                    numel = 1
                    for d in shape:
                        numel *= d
                    size = numel * _dtype_bytes(part.get_dtype())
                    total += size
                    tensors.add_row(key, str(tuple(shape)), part.get_dtype(), f"{size / 2**20:.2f}")
        except Exception as err:  # noqa: BLE001
            raise BestiaryError(f"{rank_path}: not a readable .safetensors file ({err})") from None
        tensors.add_section()
        tensors.add_row("total", "", "", f"{total / 2**20:.2f}")
        out.print(tensors)
    out.print(cpu_kernels_table())
    out.print(decode_plan_table(data, str(directory / "config.json")))
    return 0


def decode_plan_table(data: dict, source: str) -> Table:
    """How CPU decode steps of this model run: as one compiled plan, or eagerly and why
    (core.runtime.cpu_plan.refusal on rank 0's model, built on the meta device)."""
    import torch

    from bestiary.core.format.config import config_sections
    from bestiary.core.runtime.cpu_plan import refusal
    from bestiary.core.runtime.engine import validate_model_config
    from bestiary.registry import default_registry, resolve

    table = Table(title="CPU decode steps (this model)")
    table.add_column("field")
    table.add_column("value")
    model_data, build_data = config_sections(data, source)
    try:
        config = validate_model_config(model_data, source, prefix="pretrained_config." if build_data else "")
        with torch.device("meta"):
            model = resolve(default_registry().get(config.architecture).model_class)(config, 0, device="meta")
        reason = refusal(model, placed=False)
    except (BestiaryError, TypeError, ValueError) as err:
        table.add_row("decode plan", f"unknown: {' '.join(str(err).split())[:200]}")
        return table
    table.add_row("decode plan", "compiled (one call a step)" if reason is None else f"eager: {reason}")
    return table


def cpu_kernels_table() -> Table:
    """The CPU kernels' path on this machine (core.kernels.cpu.build.describe): ISA chosen and why."""
    from bestiary.core.kernels.cpu.build import describe

    table = Table(title="CPU kernels (this machine)")
    table.add_column("field")
    table.add_column("value")
    for key, value in describe().items():
        table.add_row(key, value)
    return table


def _dtype_bytes(name: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1, "BOOL": 1}.get(name, 4)


def add_list_parser(sub: SubParsers) -> None:
    """`bestiary list` (no flags)."""
    sub.add_parser("list", help="registered architectures")


@command("list", add_list_parser)
def cmd_list(args: argparse.Namespace) -> int:
    from bestiary.registry import capabilities, default_registry

    registry = default_registry()
    specs = [registry.specs[name] for name in registry.names()]
    cells = [capabilities.columns(spec) for spec in specs]
    caps = list(dict.fromkeys(col for row in cells for col in row))  # LoRA only once some spec declares it
    table = Table(title="bestiary architectures (TP/PP/EP: tensor/pipeline/expert parallel; quant: algorithms)")
    for col in ("architecture", "package", "HF architectures", "model types", *caps):
        table.add_column(col, no_wrap=col not in ("quant", "LoRA"))
    table.add_column("description")
    for spec, row in zip(specs, cells, strict=True):
        table.add_row(spec.name, spec.package, ", ".join(spec.hf_architectures), ", ".join(spec.hf_model_types),
                      *(row.get(col, "-") for col in caps), spec.description)
    stdout_console().print(table)
    for failure in registry.failures:
        ERR.print(f"[red]plugin {failure.name!r} (package {failure.package}) failed to load:[/red]")
        ERR.print(failure.traceback, markup=False, highlight=False)
    return 0


def add_cache_parser(sub: SubParsers) -> None:
    """`bestiary cache list|clear`."""
    p = sub.add_parser("cache", help="list or clear the cache (LLM(source) conversions, demo, CPU kernels)")
    p.add_argument("action", choices=["list", "clear"],
                   help="list: each entry, its source and size (hard-linked files counted once in the total); "
                        "clear: remove what bestiary put there.")


@command("cache", add_cache_parser)
def cmd_cache(args: argparse.Namespace) -> int:
    from bestiary.core.format.cache import cache_dir, cache_entries, cache_total, clear_cache

    if args.action == "clear":
        freed = clear_cache()
        ERR.print(f"cache {cache_dir()} cleared: {freed / 2**20:.1f} MiB freed")
        return 0
    entries = cache_entries()
    shared = any(e.shared for e in entries)
    table = Table(title=f"bestiary cache: {cache_dir()}", caption=(
        "shared MiB: hard links to files of an entry above (an engine's weights to its checkpoint's), counted once "
        "in the total" if shared else None))
    for col in ("kind", "name", "source", "MiB", *(["shared MiB"] if shared else [])):
        table.add_column(col, justify="right" if "MiB" in col else "left", no_wrap=col != "source")
    for e in entries:
        table.add_row(e.kind, e.name, e.source, f"{e.size / 2**20:.1f}", f"{e.shared / 2**20:.1f}" if e.shared else "")
    table.add_section()
    table.add_row("total on disk", "", "", f"{cache_total(entries) / 2**20:.1f}", *([""] if shared else []))
    stdout_console().print(table)
    return 0


def add_demo_parser(sub: SubParsers) -> None:
    """`bestiary demo`'s flags: the prompt, output length, dtype, where to work, threads and device."""
    p = sub.add_parser("demo", help="convert, build and chat with the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.",
                   help="The user message.")
    p.add_argument("--max_output_len", type=positive_int, default=64, help="New tokens at most (greedy).")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the converted weights.")
    p.add_argument("--workdir", type=path_arg, default=None,
                   help="Where to put the checkpoint and engine (default: $BESTIARY_CACHE/demo, "
                        "~/.cache/bestiary/demo).")
    p.add_argument("--num_threads", type=thread_count, default=None, help=THREADS_HELP)
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)


@command("demo", add_demo_parser)
def cmd_demo(args: argparse.Namespace) -> int:
    from bestiary.core.cli.demo import run_demo

    return run_demo(args.prompt, args.max_output_len, args.dtype, args.workdir, device=args.device)
