"""`bestiary serve`: the OpenAI-compatible server (core.serve) on one engine, with uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bestiary.core.cli.main import THREADS_HELP, command
from bestiary.core.cli.model_arg import add_model_args, given_model, model_label, model_name, resolve_model
from bestiary.core.cli.parsing import path_arg, positive_float, positive_int, thread_count
from bestiary.core.cli.speculative_flags import add_speculative_flags
from bestiary.core.format.errors import BestiaryError
from bestiary.core.serve.settings import DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from bestiary.core.cli.main import SubParsers


def add_serve_parser(sub: SubParsers) -> None:
    """`bestiary serve`'s flags: the engine, the address, the API, LoRA adapters, logging, speculative decoding."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server for an engine (docs/serving.md)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (127.0.0.1: this host only).")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on, 0 to 65535.")
    p.add_argument("--api_key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/* (default: none, every request is served).")
    p.add_argument("--served_model_name", default=None, help="Model id of the API (default: MODEL's name, a file's without its suffix).")
    p.add_argument("--max_queue_len", type=positive_int, default=1024,
                   help="Requests that may wait for their first token; more are answered 503.")
    p.add_argument("--max_request_bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="Largest request body taken (default: %(default)s, 8 MiB); a larger one is answered 413 "
                        "before it is read.")
    p.add_argument("--request_timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="Cancel a request still running this long after it was accepted (408, or an error event in "
                        "a stream); every slot and KV block it held comes back. Default: no limit.")
    p.add_argument("--pooling", choices=["last", "mean"], default=None,
                   help="How /v1/embeddings pools a prompt's hidden states (default: the model's; last token for "
                        "causal LMs).")
    p.add_argument("--chat_template", type=path_arg, default=None, metavar="FILE",
                   help="Jinja2 chat template replacing the model's (or a tokenizer_config.json with one; "
                        "default: the model's).")
    p.add_argument("--tool_parser", default="auto", choices=["auto", "hermes", "llama3", "mistral"],
                   help="How tool calls are read from the model's text: hermes <tool_call>{...}</tool_call>, llama3 "
                        "{\"name\", \"parameters\"}, mistral [TOOL_CALLS] [...] (default: %(default)s, the chat "
                        "template's own format; hermes for a template without tools). docs/serving.md")
    p.add_argument("--lora_modules", nargs="+", default=None, metavar="NAME=DIR",
                   help="HF PEFT LoRA adapters served as model names (loaded at start; default: none).")
    p.add_argument("--num_threads", type=thread_count, default=None, help=THREADS_HELP)
    p.add_argument("--log_level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (its access log lines come at info).")
    add_speculative_flags(p)


@command("serve", add_serve_parser)
def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from bestiary.core.serve.app import ServeSettings, create_app, load_chat_template
    except ImportError as err:
        raise BestiaryError(f"bestiary serve needs the serve extra ({err.name} is missing): "
                            "pip install 'bestiary[serve]'") from None
    from bestiary.core.cli.speculative_flags import speculative_from_args
    from bestiary.core.lora.request import LoraRequest
    from bestiary.core.runtime.llm import LLM

    if not 0 <= args.port <= 65535:
        raise BestiaryError(f"--port {args.port}: expected 0..65535")
    name = args.served_model_name or model_name(given_model(args))
    adapters = lora_modules(args.lora_modules or [], name)
    template = load_chat_template(args.chat_template) if args.chat_template else None
    speculative = speculative_from_args(args)
    llm = LLM(resolve_model(args), num_threads=args.num_threads, speculative=speculative)
    llm.executor.kv.commit()  # the KV pool resident from the start: memory does not creep up under load
    if template is not None:
        if llm.tokenizer is None:
            raise BestiaryError(f"--chat_template: {model_label(args)} has no tokenizer to render it with")
        llm.tokenizer.chat_template = template
    for adapter, path in adapters.items():  # a bad adapter is named now, not at its first request
        llm.lora_store.get(LoraRequest(adapter, path))
    app = create_app(llm, ServeSettings(served_model_name=name, api_key=args.api_key,
                                        max_queue_len=args.max_queue_len, lora_modules=adapters,
                                        max_request_bytes=args.max_request_bytes,
                                        request_timeout=args.request_timeout, pooling=args.pooling,
                                        tool_parser=args.tool_parser))
    print(f"bestiary serve: {', '.join(map(repr, [name, *adapters]))} on http://{args.host}:{args.port}/v1 "
          f"(chat page: http://{args.host}:{args.port}/)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        llm.close()
    return 0


def lora_modules(specs: list[str], base_name: str) -> dict[str, str]:
    """--lora_modules NAME=DIR ... -> {name: dir}; a malformed, repeated or missing one is a one-line error."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory:
            raise BestiaryError(f"--lora_modules {spec}: expected NAME=DIR")
        if name == base_name or name in adapters:
            raise BestiaryError(f"--lora_modules {spec}: the model name {name!r} is already served")
        if not Path(directory).is_dir():
            raise BestiaryError(f"--lora_modules {spec}: {directory} is not a directory")
        adapters[name] = directory
    return adapters
