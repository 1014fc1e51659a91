"""A third-party grammar backend (hook `bestiary_register_grammar_backends`, docs/logits-processors.md):
a pure-Python backend that supports `choice` only, by the token ids of each choice. Requests that name it
(`GuidedConfig(backend="token_choice")`) are held by it, in one batch with llguidance-guided and free
requests; a kind it refuses, an unknown backend and a broken factory end as one line."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.guided import GuidedConfig  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.plugins import hookimpl  # noqa: E402
from bestiary.registry import Registry  # noqa: E402

PROMPT = "Pick one"


class TokenChoiceMatcher:
    """One sequence among the choices' token id lists: the GrammarMatcher interface."""

    def __init__(self, choices: list[list[int]], stop_ids: set[int], vocab_size: int) -> None:
        self.choices, self.stop_ids = choices, stop_ids
        self.words = (vocab_size + 31) // 32
        self.ids: list[int] = []
        self.error: str | None = None

    def _next(self) -> set[int]:
        n = len(self.ids)
        alive = [c for c in self.choices if c[:n] == self.ids]
        allowed = {c[n] for c in alive if len(c) > n}
        return allowed | (self.stop_ids if any(len(c) == n for c in alive) else set())

    def fill(self, mask: torch.Tensor, row: int) -> None:
        bits = torch.zeros(self.words * 32, dtype=torch.int64)
        bits[sorted(self._next())] = 1
        words = (bits.view(self.words, 32) << torch.arange(32)).sum(1)  # [W] int64, bit 31 may be set
        mask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def accept(self, token: int) -> bool:
        if token not in self._next():
            self.error = f"token {token} is not a continuation"
            return False
        self.ids.append(token)
        return True

    def take(self, token: int) -> None:
        if not self.accept(token):
            raise RuntimeError(self.error)

    def valid_prefix(self, tokens: list[int]) -> int:
        kept = list(self.ids)
        count = 0
        for token in tokens:
            if not self.accept(token):
                break
            count += 1
        self.ids, self.error = kept, None
        return count

    def rollback(self, count: int) -> None:
        del self.ids[len(self.ids) - count:]

    @property
    def stopped(self) -> bool:
        n = len(self.ids)
        return any(c == self.ids for c in self.choices) and not any(len(c) > n and c[:n] == self.ids
                                                                     for c in self.choices)


class TokenChoiceCompiler:
    """factory(tokenizer_json, vocab_size, stop_ids) -> this: `check` and `matcher`, choices only."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: set[int]) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.made = 0

    def check(self, config: GuidedConfig) -> None:
        if config.kind != "choice":
            raise BestiaryError(f"guided {config.kind}: the token_choice backend takes choice only")

    def matcher(self, config: GuidedConfig) -> TokenChoiceMatcher:
        self.check(config)
        self.made += 1
        ids = [self.tokenizer.encode(c, add_special_tokens=False).ids for c in config.choice or []]
        return TokenChoiceMatcher(ids, self.stop_ids, self.vocab_size)


COMPILERS: list[TokenChoiceCompiler] = []


def make_compiler(tokenizer_json: str, vocab_size: int, stop_ids: set[int]) -> TokenChoiceCompiler:
    COMPILERS.append(TokenChoiceCompiler(tokenizer_json, vocab_size, stop_ids))
    return COMPILERS[-1]


def plugin(factory) -> types.ModuleType:
    module = types.ModuleType("token_choice_plugin")
    module.bestiary_register_grammar_backends = hookimpl(  # type: ignore[attr-defined]
        lambda register: register("token_choice", factory))
    return module


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = make_tiny_chat_engine(tmp_path_factory.mktemp("grammar_backend"), max_batch_size=8)
    return LLM(engine, registry=Registry.from_plugins({"token_choice": plugin(make_compiler)}))


def test_the_plugin_backend_holds_its_requests_beside_others(llm):
    choices = ["alpha", "beta gamma", "delta"]
    mine = GuidedConfig(choice=choices, backend="token_choice")
    builtin = GuidedConfig(regex="[0-9]{3}")
    configs = [SamplingConfig(max_new_tokens=12, temperature=1.0, random_seed=s, guided=mine) for s in range(4)]
    configs += [SamplingConfig(max_new_tokens=12, temperature=0.0, guided=builtin),
                SamplingConfig(max_new_tokens=6, temperature=0.0)]
    outs = llm.generate([PROMPT] * len(configs), configs)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs[:4]), [o.text for o in outs]
    assert len(outs[4].text) == 3 and outs[4].text.isdigit()
    assert COMPILERS and COMPILERS[-1].made == 4  # the plugin's matchers held the four requests
    alone = llm.generate(PROMPT, SamplingConfig(max_new_tokens=6, temperature=0.0))[0]
    assert outs[5].output_ids == alone.output_ids


def test_refusals_are_one_line(llm):
    with pytest.raises(BestiaryError, match="the token_choice backend takes choice only"):
        llm.generate(PROMPT, SamplingConfig(guided=GuidedConfig(regex="a", backend="token_choice")))
    with pytest.raises(BestiaryError, match="guided backend 'nope': not a registered grammar backend; registered: "
                                            "llguidance, token_choice"):
        llm.generate(PROMPT, SamplingConfig(guided=GuidedConfig(choice=["a"], backend="nope")))
    assert not llm.executor.has_work


def test_a_broken_factory_is_named(tmp_path_factory):
    def broken(tokenizer_json, vocab_size, stop_ids):
        raise KeyError("vocab")

    engine = make_tiny_chat_engine(tmp_path_factory.mktemp("broken_backend"), max_batch_size=2)
    llm = LLM(engine, registry=Registry.from_plugins({"broken": plugin(broken)}))
    with pytest.raises(BestiaryError, match=r"guided backend 'token_choice' \(from .*\): 'vocab'"):
        llm.generate(PROMPT, SamplingConfig(guided=GuidedConfig(choice=["a"], backend="token_choice")))
    assert llm.generate(PROMPT, SamplingConfig(max_new_tokens=2))[0].finish_reason in ("stop", "length")


def test_the_server_field_names_the_backend():
    """The server's guided_decoding_backend goes into the request's GuidedConfig (the protocol's one place)."""
    from bestiary.core.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"],
        "guided_decoding_backend": "token_choice"})
    assert body.guided() == GuidedConfig(choice=["a", "b"], backend="token_choice")
    plain = body.model_copy(update={"guided_decoding_backend": None})
    assert plain.guided() == GuidedConfig(choice=["a", "b"])
