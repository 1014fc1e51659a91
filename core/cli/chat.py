"""`bestiary chat`: a conversation with an engine in the terminal, or one answer per line from a pipe.

Each turn renders the whole conversation (system prompt, earlier turns, the new message)
with the model's chat template and streams the answer; the answer joins the history.
When the rendered conversation exceeds the engine's max_input_len, the oldest turns are
dropped (said on stderr). Lines starting with / are commands:

    /reset          forget the conversation (the system prompt stays)
    /system TEXT    set the system prompt (`/system` alone clears it); the history stays
    /exit           leave (also /quit, end of input, Ctrl-D)
    /help           list the commands

A terminal gets a prompt, the answer rendered as Markdown while it streams, and
"N tokens, X tokens/s" after it (N generated tokens / seconds from the request to its last
token, prefill included); Ctrl-C stops an answer. From a pipe, each input line is one
message and its answer is written to stdout followed by a newline; the statistics go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console

from bestiary.core.cli.main import command
from bestiary.core.cli.parsing import path_arg, positive_int, thread_count
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.cli.main import SubParsers

HELP = ("/reset: forget the conversation   /system TEXT: set the system prompt (empty: none)   "
        "/exit: leave   /help: this list")


@dataclass
class Conversation:
    """The system prompt and the turns so far (user and assistant messages, alternating)."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """What the chat template renders: the system message (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def drop_oldest_turn(self) -> bool:
        """Forget the oldest user message and its answer; False when only the newest message is left."""
        if len(self.turns) < 3:  # the newest message stays, with what it answers
            return False
        del self.turns[:2]
        return True


def prompt_ids(llm, conversation: Conversation, err: Console) -> list[int]:
    """The conversation's token ids, dropping its oldest turns until they fit max_input_len.

    A newest message too long by itself is an error, and the conversation is left as it was."""
    limit = llm.engine.build.max_input_len
    trial = Conversation(conversation.system, list(conversation.turns))
    ids = llm.chat_ids(trial.messages())
    while len(ids) > limit and trial.drop_oldest_turn():
        ids = llm.chat_ids(trial.messages())
    if len(ids) > limit:
        raise BestiaryError(f"message: {len(ids)} tokens with the chat template exceed the engine's "
                            f"max_input_len {limit}")
    dropped = (len(conversation.turns) - len(trial.turns)) // 2
    if dropped:
        conversation.turns[:] = trial.turns
        err.print(f"(the {dropped} oldest turn(s) were dropped: the conversation exceeded max_input_len {limit})",
                  style="dim", highlight=False)
    return ids


def sampling_config(args: argparse.Namespace, prompt_len: int, max_seq_len: int):
    """The answer's SamplingConfig: the flags, with max_new_tokens cut to what max_seq_len leaves."""
    from bestiary.core.runtime.sampling import SamplingConfig

    return SamplingConfig(max_new_tokens=max(min(args.max_output_len, max_seq_len - prompt_len), 1),
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          random_seed=args.random_seed)


class ChatScreen:
    """Where a conversation is shown: a terminal (prompt, Markdown, Ctrl-C stops) or a pipe (plain text)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.out = Console(highlight=False) if interactive else None  # None exactly when not interactive
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message, piped or not

    def lines(self) -> Iterator[str]:
        """The user's lines until end of input (or Ctrl-C / Ctrl-D at the prompt)."""
        while True:
            try:
                line = self.out.input("[bold green]you>[/] ") if self.out is not None else sys.stdin.readline()
            except (EOFError, KeyboardInterrupt):
                return
            if not self.interactive and not line:
                return
            yield line.rstrip("\n")

    def note(self, text: str) -> None:
        self.err.print(text, style="dim", markup=False)

    def show_answer(self, pieces: Generator[str, None, None]) -> str:
        """Stream `pieces` (LLM.generate_stream's text deltas) to the screen; the answer so far (Ctrl-C
        in a terminal stops it, and closing `pieces` cancels the request)."""
        answer = ""
        if not self.interactive:
            for piece in pieces:
                answer += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            return answer
        from rich.live import Live
        from rich.markdown import Markdown  # markdown_it and pygments: loaded for a terminal's answers only

        try:
            with Live(Markdown(""), console=self.out, refresh_per_second=12, vertical_overflow="visible") as live:
                for piece in pieces:
                    answer += piece
                    live.update(Markdown(answer))
        except KeyboardInterrupt:
            self.note("(stopped)")
        finally:
            pieces.close()  # a stopped answer cancels its request
        return answer


def run_command(line: str, conversation: Conversation, screen: ChatScreen) -> bool:
    """Carry out a /command; False for /exit."""
    name, _, rest = line.partition(" ")
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        conversation.turns.clear()
        screen.note("(conversation forgotten)")
    elif name == "/system":
        conversation.system = rest.strip() or None
        screen.note(f"(system prompt: {conversation.system!r})")
    elif name == "/help":
        screen.note(HELP)
    else:
        screen.note(f"unknown command {name}; {HELP}")
    return True


def answer_turn(llm, args: argparse.Namespace, conversation: Conversation, screen: ChatScreen, text: str) -> None:
    """Add the user's message, stream the answer, keep it in the history, show tokens/s."""
    conversation.turns.append({"role": "user", "content": text})
    try:
        ids = prompt_ids(llm, conversation, screen.err)
    except BestiaryError as err:
        conversation.turns.pop()
        screen.err.print(f"error: {err}", markup=False)
        return
    sampling = sampling_config(args, len(ids), llm.engine.build.max_seq_len)
    answer = screen.show_answer(llm.generate_stream(ids, sampling))
    conversation.turns.append({"role": "assistant", "content": answer})
    stats = llm.last_stats
    screen.note(f"[{stats.generated_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s]")


def add_chat_parser(sub: SubParsers) -> None:
    """`bestiary chat`'s flags: the engine, the system prompt and the sampling of the answers."""
    p = sub.add_parser("chat", help="chat with an engine in the terminal (or one answer per line from a pipe)")
    p.add_argument("--engine_dir", type=path_arg, required=True,
                   help="An engine or checkpoint directory (or any source run takes).")
    p.add_argument("--system", default=None, metavar="TEXT", help="The system prompt (/system TEXT changes it).")
    p.add_argument("--max_output_len", type=positive_int, default=256, help="New tokens per answer at most.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    p.add_argument("--top_k", type=int, default=0, help="0 = off.")
    p.add_argument("--top_p", type=float, default=1.0, help="1.0 = off.")
    p.add_argument("--random_seed", type=int, default=None)
    p.add_argument("--num_threads", type=thread_count, default=None, help="torch CPU threads.")


@command("chat", add_chat_parser)
def cmd_chat(args: argparse.Namespace) -> int:
    from bestiary.core.runtime.llm import LLM

    llm = LLM(args.engine_dir, num_threads=args.num_threads)
    if llm.tokenizer is None:
        raise BestiaryError(f"--engine_dir {args.engine_dir}: the engine has no tokenizer; chat needs one")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    screen = ChatScreen(interactive)
    conversation = Conversation(system=args.system or None)
    if interactive:
        screen.note(f"bestiary chat: {args.engine_dir}   {HELP}")
    try:
        for line in screen.lines():
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not run_command(text, conversation, screen):
                    break
                continue
            answer_turn(llm, args, conversation, screen, text)
    finally:
        llm.close()
    return 0
