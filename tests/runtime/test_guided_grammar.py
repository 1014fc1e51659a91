"""core.runtime.guided on SmolLM2's tokenizer: the config's one-kind rule, each kind's grammar walked
token by token, the bitmask unpacking against a per-token reference, errors as one line, the cache."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.guided import (
    GRAMMAR_CACHE,
    GrammarCompiler,
    GuidedConfig,
    apply_bitmask,
    fill_masks,
    unpack_bitmask,
)

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer_json(smollm2_gguf) -> str:
    from bestiary.core.sources.gguf_source import open_gguf

    tok = open_gguf(smollm2_gguf).tokenizer
    assert tok is not None
    return tok.tokenizer_json


@pytest.fixture(scope="module")
def compiler(tokenizer_json) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_json, VOCAB, {EOS})


@pytest.fixture(scope="module")
def encode(tokenizer_json):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def allowed_after(compiler: GrammarCompiler, config: GuidedConfig, ids: list[int]) -> tuple[torch.Tensor, bool]:
    """(allowed next tokens [V] bool, stopped) after walking `ids`; every id must be accepted."""
    matcher = compiler.matcher(config)
    for token in ids:
        assert matcher.accept(token), f"token {token} refused ({matcher.error})"
    return unpack_bitmask(fill_masks([matcher]), VOCAB)[0], matcher.stopped


def test_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedConfig()
    with pytest.raises(ValueError, match="given: regex, choice"):
        GuidedConfig(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="empty string"):
        GuidedConfig(choice=["a", ""])
    assert GuidedConfig(json_object=True).kind == "json_object"


@pytest.mark.parametrize("config, text", [
    (GuidedConfig(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                               "additionalProperties": False}), '{"a": 12}'),
    (GuidedConfig(choice=["yes", 'no "quoted"\n']), 'no "quoted"\n'),
    (GuidedConfig(grammar='root ::= "a" [0-9]+ "b"'), "a12b"),
])
def test_complete_output_stops_and_allows_only_the_end(compiler, encode, config, text) -> None:
    allowed, stopped = allowed_after(compiler, config, encode(text))
    assert stopped
    assert allowed.nonzero().flatten().tolist() == [EOS]


def test_end_only_where_the_grammar_accepts(compiler, encode) -> None:
    config = GuidedConfig(regex=r"[A-Z][a-z]+ \d{4}")
    unfinished, _ = allowed_after(compiler, config, encode("Paris 20"))
    assert not unfinished[EOS] and unfinished.any()
    done, stopped = allowed_after(compiler, config, encode("Paris 2024"))
    assert done[EOS] and stopped


def test_refused_token_leaves_the_matcher_in_error(compiler, encode) -> None:
    matcher = compiler.matcher(GuidedConfig(choice=["yes", "no"]))
    assert not matcher.accept(encode("maybe")[0])
    assert matcher.error


def test_valid_prefix_and_rollback(compiler, encode) -> None:
    config = GuidedConfig(json_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                       "required": ["n"], "additionalProperties": False})
    good, bad = encode('{"n": 1'), encode("]")
    matcher = compiler.matcher(config)
    assert matcher.valid_prefix(good + bad) == len(good)
    start = fill_masks([matcher])
    for token in good:
        assert matcher.accept(token)
    matcher.rollback(len(good))
    assert torch.equal(fill_masks([matcher]), start)


def test_unpack_matches_a_per_token_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)  # [N, W]
    vocab = 150  # not a multiple of 32: the last word is cut
    expected = torch.tensor([[bool((int(mask[n, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                             for n in range(3)])
    assert torch.equal(unpack_bitmask(mask, vocab), expected)
    x = torch.randn(3, vocab)
    masked = apply_bitmask(x, mask)
    assert torch.equal(masked[expected], x[expected]) and bool((masked[~expected] == float("-inf")).all())


@pytest.mark.parametrize("config, message", [
    (GuidedConfig(regex="(abc"), r"guided regex: .*unclosed group"),
    (GuidedConfig(grammar="root ::= foo"), "guided grammar: not a GBNF grammar: Rule 'foo' not found"),
    (GuidedConfig(grammar="start: bar"), "guided grammar: .*bar"),
    (GuidedConfig(json_schema={"type": "strin"}), "guided json_schema: .*strin"),
    (GuidedConfig(json_schema={"type": "string", "format": "weird"}), "guided json_schema: .*weird"),
])
def test_bad_constraints_are_one_line_errors(compiler, config, message) -> None:
    with pytest.raises(BestiaryError, match=message) as err:
        compiler.check(config)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_compiled_grammars_are_cached_and_bounded(tokenizer_json) -> None:
    compiler = GrammarCompiler(tokenizer_json, VOCAB, {EOS})
    first = compiler._template(GuidedConfig(regex="a+"))
    assert compiler._template(GuidedConfig(regex="a+")) is first
    for i in range(GRAMMAR_CACHE):
        compiler.check(GuidedConfig(regex=f"b{{{i + 1}}}"))
    assert len(compiler._cache) == GRAMMAR_CACHE
    assert compiler._template(GuidedConfig(regex="a+")) is not first  # evicted, compiled again
