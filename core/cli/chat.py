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
token, prefill included). Keys, as in a shell or Python's REPL:

    Ctrl-C during an answer   stop it: what was shown stays, once, and stays in the conversation
                              as the assistant's turn; the prompt comes back
    Ctrl-C at the prompt      discard the line typed and say how to leave; a second Ctrl-C within
                              DOUBLE_CTRL_C_S (2 s) leaves
    Ctrl-D at an empty prompt leave (end of input)

Keys typed while an answer streams are not echoed and are dropped when it ends. From a pipe, each
input line is one message and its answer is written to stdout followed by a newline; the
statistics go to stderr. An error line (a rank that died) never continues a half-written answer
(core.format.stream_line).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import termios
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console

from bestiary.core.cli.guided_flags import add_guided_flags, check_guided, guided_from_args
from bestiary.core.cli.main import SEED_HELP, THREADS_HELP, command
from bestiary.core.cli.model_arg import add_model_args, model_label, resolve_model
from bestiary.core.cli.parsing import positive_int, thread_count
from bestiary.core.format import stream_line
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.cli.main import SubParsers

HELP = ("/reset: forget the conversation   /system TEXT: set the system prompt (empty: none)   "
        "/exit: leave   /help: this list   Ctrl-C: stop an answer (it stays in the conversation)")
LEAVE_HINT = "(Ctrl-D or /exit to leave, or Ctrl-C again)"
DOUBLE_CTRL_C_S = 2.0  # a second Ctrl-C at the prompt within this many seconds of the first leaves


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
                          random_seed=args.random_seed, guided=getattr(args, "guided_config", None))


class ChatScreen:
    """Where a conversation is shown: a terminal (prompt, Markdown, Ctrl-C stops) or a pipe (plain text)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.out = Console(highlight=False) if interactive else None  # None exactly when not interactive
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message, piped or not

    def lines(self) -> Iterator[str]:
        """The user's lines until they leave (end of input; in a terminal also a second Ctrl-C at once)."""
        while (line := self.read_line()) is not None:
            yield line

    def read_line(self) -> str | None:
        """The next line, or None to leave. At a terminal's prompt Ctrl-C discards the line typed, ends
        its line and says how to leave; a second Ctrl-C within DOUBLE_CTRL_C_S, or Ctrl-D, leaves."""
        if self.out is None:
            try:
                line = sys.stdin.readline()
            except KeyboardInterrupt:
                return None
            return line.rstrip("\n") if line else None
        first_ctrl_c: float | None = None
        while True:
            try:
                return self.out.input("[bold green]you>[/] ")
            except EOFError:
                self.out.print()  # the shell's prompt on a line of its own
                return None
            except KeyboardInterrupt:
                self.out.print()  # end the line the terminal echoed "^C" on
                now = time.monotonic()
                if first_ctrl_c is not None and now - first_ctrl_c < DOUBLE_CTRL_C_S:
                    return None
                first_ctrl_c = now
                self.note(LEAVE_HINT)

    def note(self, text: str) -> None:
        self.err.print(text, style="dim", markup=False)

    def show_answer(self, pieces: Generator[str, None, None]) -> str:
        """Stream `pieces` (LLM.generate_stream's text deltas) to the screen; the answer as shown (Ctrl-C
        in a terminal stops it, and closing `pieces` cancels the request)."""
        answer = ""
        if self.out is None:
            for piece in pieces:
                answer += piece
                stream_line.write(piece)  # an error line meanwhile starts on a line of its own
            stream_line.write("\n")
            return answer
        from rich.live import Live
        from rich.markdown import Markdown  # markdown_it and pygments: loaded for a terminal's answers only

        live = Live(Markdown(""), console=self.out, refresh_per_second=12, vertical_overflow="visible")
        stopped = False
        try:
            with keys_not_echoed(), live:
                stream_line.set_mid_line(True)  # Live leaves the cursor after its last line until it stops
                for piece in pieces:
                    answer += piece
                    live.update(Markdown(answer))
        except KeyboardInterrupt:
            stopped = True
        finally:
            stream_line.set_mid_line(False)
            pieces.close()  # a stopped answer cancels its request
        if stopped:
            self.note("(stopped)")
        shown = live.renderable  # Live's last drawing: Ctrl-C may land after `answer += piece`, before its update
        return shown.markup if isinstance(shown, Markdown) else answer


@contextlib.contextmanager
def keys_not_echoed() -> Iterator[None]:
    """While an answer streams, the terminal neither echoes keys nor flushes its output on Ctrl-C; keys
    typed meanwhile are dropped at the end (never sent unseen as the next message).

    Live redraws an answer by moving the cursor up over the lines it drew. The "^C" a terminal echoes
    after a full-width line wrapped the cursor one line down, so the final redraw started a line low and
    the answer's first line stayed on the screen twice; an output flush on Ctrl-C (no NOFLSH) could
    likewise drop part of a drawing the cursor moves count on."""
    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (OSError, ValueError, termios.error):  # not a terminal: nothing to change
        yield
        return
    quiet = list(saved)
    quiet[3] = (quiet[3] & ~termios.ECHO) | termios.NOFLSH  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)  # TCSAFLUSH: the keys typed meanwhile are dropped


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
    """Add the user's message, stream the answer, keep it in the history, show tokens/s. An answer stopped
    with Ctrl-C stays in the history as it was shown (the next message continues from it)."""
    conversation.turns.append({"role": "user", "content": text})
    try:
        ids = prompt_ids(llm, conversation, screen.err)
    except (BestiaryError, KeyboardInterrupt) as err:  # the message is not sent: the conversation stays as it was
        conversation.turns.pop()
        if isinstance(err, KeyboardInterrupt):
            screen.note("(stopped)")
        else:
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
    add_model_args(p)
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="The system prompt (/system TEXT changes it; default: none).")
    p.add_argument("--max_output_len", type=positive_int, default=256, help="New tokens per answer at most.")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 = greedy.")
    p.add_argument("--top_k", type=int, default=0, help="Keep the k most likely tokens; 0 = off.")
    p.add_argument("--top_p", type=float, default=1.0, help="Keep the tokens whose probability sums to p; 1.0 = off.")
    p.add_argument("--random_seed", type=int, default=None, help=SEED_HELP)
    p.add_argument("--num_threads", type=thread_count, default=None, help=THREADS_HELP)
    add_guided_flags(p)  # every answer held to the constraint


@command("chat", add_chat_parser)
def cmd_chat(args: argparse.Namespace) -> int:
    from bestiary.core.runtime.llm import LLM

    args.guided_config, guided_flag = guided_from_args(args)  # a missing or unreadable file: before the engine loads
    llm = LLM(resolve_model(args), num_threads=args.num_threads)
    if llm.tokenizer is None:
        raise BestiaryError(f"{model_label(args)}: the engine has no tokenizer; chat needs one")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    screen = ChatScreen(interactive)
    conversation = Conversation(system=args.system or None)
    if interactive:
        screen.note(f"bestiary chat: {args.model or args.engine_dir}   {HELP}")
    try:
        check_guided(llm, args.guided_config, guided_flag)
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
