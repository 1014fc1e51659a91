"""A third-party logits processor (docs/logits-processors.md): tests/data/ban_digits_plugin is found through
its pyproject.toml's entry point (`local_registry`, no pip install), registered by the hook
`bestiary_register_logits_processors`, and applied per request on a tiny chat engine: through
`LLM.generate`, in one batch with requests that do not ask for it, and through the server's
`logits_processors` field. Bad registrations, unknown names and bad args end as one line."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.guided import GuidedConfig  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.plugins import hookimpl  # noqa: E402
from bestiary.registry import Registry  # noqa: E402
from bestiary.testing.local_plugins import local_registry  # noqa: E402

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "data" / "ban_digits_plugin"
PROMPT = "Numbers: 0 1 2"
DIGITS = "0123456789"


def plugin_module(name: str, hook) -> types.ModuleType:
    """A plugin module whose only hook implementation is `hook` (a processor-registering function)."""
    module = types.ModuleType(name)
    module.bestiary_register_logits_processors = hookimpl(hook)  # type: ignore[attr-defined]
    return module


def recorder(seen: list[torch.Tensor]):
    """A plugin registering "record" (keeps a copy of each logits it gets) and "boost" (+by at args id)."""
    def record(args, context):
        return lambda ids, x: (seen.append(x.clone()), x)[1]

    def boost(args, context):
        token, by = int(args["id"]), float(args.get("by", 100.0))

        def processor(ids, x):
            x[token] += by
            return x
        return processor

    def register_all(register):
        register("record", record)
        register("boost", boost)
    return plugin_module("recorder", register_all)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("processors"), max_batch_size=8)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return local_registry(PLUGIN_DIR)


@pytest.fixture(scope="module")
def llm(engine, registry):
    from bestiary.core.runtime.llm import LLM

    return LLM(engine, registry=registry)


@pytest.fixture(scope="module")
def digit_ids(llm) -> list[int]:
    strings = llm.tokenizer.token_strs(list(range(llm.engine.model.config.vocab_size)))
    ids = [i for i, s in enumerate(strings) if any(c in DIGITS for c in s)]  # not "²": a byte-level char
    assert len(ids) >= 10, "the tiny tokenizer's corpus holds the digits 0-12"
    return ids


def greedy(**fields) -> SamplingConfig:
    return SamplingConfig(**({"max_new_tokens": 12, "temperature": 0, "ignore_eos": True} | fields))


def test_the_plugin_package_registers_ban_digits(registry):
    named = registry.logits_processor("ban_digits")
    assert named.package == "bestiary_ban_digits" and callable(named.factory)
    assert not [f for f in registry.failures if "ban_digits" in f.name]


def test_it_changes_only_the_requests_that_ask_for_it_in_one_batch(llm, digit_ids):
    """Digits biased +50: the request without the processor writes digits only; the same request with it
    writes none (it runs after the bias); a plain request is what it is alone."""
    bias = {i: 50.0 for i in digit_ids}
    params = [greedy(embedding_bias=bias), greedy(embedding_bias=bias, logits_processors=["ban_digits"]), greedy(),
              greedy(embedding_bias=bias, logits_processors=[{"name": "ban_digits", "args": {"keep": "1"}}])]
    batch = llm.generate([PROMPT] * 4, params)
    alone = [llm.generate([PROMPT], [p])[0].output_ids for p in params[:3]]
    assert [c.output_ids for c in batch[:3]] == alone
    assert all(t in digit_ids for t in batch[0].output_ids)
    assert not set(batch[1].output_ids) & set(digit_ids)
    assert batch[1].output_ids != batch[0].output_ids
    kept = llm.tokenizer.token_strs(batch[3].output_ids)
    assert all(set(s) & set(DIGITS) <= {"1"} for s in kept) and any("1" in s for s in kept)


def test_a_processor_runs_after_the_penalties_and_before_the_grammar(engine):
    """It gets the biased logits (raw + bias, the raw row from output_generation_logits) and the ids so
    far; a token it boosts by 1000 that the grammar forbids is never chosen."""
    from bestiary.core.runtime.llm import LLM

    seen: list[torch.Tensor] = []
    llm = LLM(engine, registry=Registry.from_plugins({"recorder": recorder(seen)}))
    out = llm.generate([PROMPT], [greedy(max_new_tokens=3, embedding_bias={5: 3.0}, output_generation_logits=True,
                                         logits_processors=["record"])])[0]
    assert len(seen) == 3
    for got, raw in zip(seen, out.generation_logits):
        expected = raw.float().clone()
        expected[5] += 3.0
        torch.testing.assert_close(got, expected)
    forbidden = llm.tokenizer.encode("Z", add_special_tokens=False)[0]
    guided = greedy(max_new_tokens=8, guided=GuidedConfig(choice=["yes", "no"]),
                    logits_processors=[{"name": "boost", "args": {"id": forbidden, "by": 1000.0}}])
    text = llm.generate([PROMPT], [guided])[0].text
    assert text in ("yes", "no")
    free = llm.generate([PROMPT], [greedy(max_new_tokens=2, logits_processors=[
        {"name": "boost", "args": {"id": forbidden, "by": 1000.0}}])])[0]
    assert free.output_ids == [forbidden, forbidden]  # the boost itself works


def test_a_guided_request_runs_its_processors_before_the_mask(engine):
    """Guided requests otherwise plain take the batched path (no chooser): one with processors must not. The
    processor sees unmasked (finite) logits, and boosting the first token of the choice greedy decoding
    did not take flips the answer."""
    from bestiary.core.runtime.llm import LLM

    seen: list[torch.Tensor] = []
    llm = LLM(engine, registry=Registry.from_plugins({"recorder": recorder(seen)}))
    choice = GuidedConfig(choice=["yes", "no"])
    unprocessed = llm.generate([PROMPT], [greedy(guided=choice)])[0].text
    recorded = llm.generate([PROMPT], [greedy(guided=choice, logits_processors=["record"])])[0]
    assert recorded.text == unprocessed and len(seen) == len(recorded.output_ids)
    assert all(bool(torch.isfinite(x).all()) for x in seen)
    other = "no" if unprocessed == "yes" else "yes"
    first = llm.tokenizer.encode(other, add_special_tokens=False)[0]
    boosted = greedy(guided=choice, logits_processors=[{"name": "boost", "args": {"id": first, "by": 1000.0}}])
    assert llm.generate([PROMPT], [boosted])[0].text == other


@pytest.mark.parametrize("entry,message", [
    ("no_such", "logits_processors: unknown processor 'no_such'; registered: ban_digits"),
    ({"name": "ban_digits", "args": {"keep": "x"}}, "logits_processors: 'ban_digits' args {'keep': 'x'}: keep 'x': "
                                                     "expected a string of digits"),
    ({"name": "ban_digits", "args": {"drop": 1}}, "unknown args ['drop']; expected 'keep'"),
])
def test_an_unknown_name_or_bad_args_is_one_line_naming_it(llm, entry, message):
    with pytest.raises(BestiaryError) as err:
        llm.generate([PROMPT], [greedy(logits_processors=[entry])])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not llm.executor.has_work  # refused before anything was queued


@pytest.mark.parametrize("value", [[{"name": "x", "arg": {}}], [{"name": 3}], [{"name": "x", "args": [1]}], [""],
                                   [{"args": {}}]])
def test_the_field_is_validated_strictly(value):
    with pytest.raises(ValidationError, match="logits_processors"):
        SamplingConfig(logits_processors=value)


def test_processors_need_the_chooser_and_no_beams_and_no_drafts():
    with pytest.raises(ValidationError, match="logits_processors with beam_width 2"):
        SamplingConfig(beam_width=2, logits_processors=["ban_digits"])
    s = SamplingConfig(logits_processors=["ban_digits"], guided=GuidedConfig(regex="a+"))
    assert s.needs_chooser and not s.guided_only  # speculative drafts are checked by the grammar only
    assert SamplingConfig(logits_processors=["ban_digits"]).needs_chooser


def test_bad_registrations_are_that_plugins_failure_and_the_others_work():
    def good(register):
        register("ok", lambda args, context: lambda ids, x: x)
    plugins = {"good": plugin_module("good", good),
               "noncallable": plugin_module("noncallable", lambda register: register("nc", 3)),
               "badname": plugin_module("badname", lambda register: register("a b", good)),
               "twice": plugin_module("twice", lambda register: (register("t", good), register("t", good))),
               "again": plugin_module("again", good)}
    reg = Registry.from_plugins(plugins)
    assert set(reg.logits_processors) == {"ok"}
    failures = {f.name: f.traceback for f in reg.failures}
    assert "is not callable" in failures["noncallable"]
    assert "'a b': expected 1-100 letters" in failures["badname"]
    assert "'t' is registered twice by 'twice'" in failures["twice"]
    assert "'ok' is registered twice: by 'good' and by 'again'" in failures["again"]


def test_a_processor_that_breaks_is_named(engine):
    from bestiary.core.runtime.llm import LLM

    def register(register):
        register("short", lambda args, context: lambda ids, x: x[:10])
        register("raises", lambda args, context: lambda ids, x: 1 / 0)
    llm = LLM(engine, registry=Registry.from_plugins({"broken": plugin_module("broken", register)}))
    with pytest.raises(BestiaryError, match=r"logits processor 'short' returned \(10,\); expected a tensor of shape"):
        llm.generate([PROMPT], [greedy(logits_processors=["short"])])
    llm2 = LLM(engine, registry=Registry.from_plugins({"broken": plugin_module("broken", register)}))
    with pytest.raises(BestiaryError, match="logits processor 'raises' failed: ZeroDivisionError"):
        llm2.generate([PROMPT], [greedy(logits_processors=["raises"])])


def test_the_server_takes_logits_processors_per_request(llm, digit_ids):
    testclient = pytest.importorskip("fastapi.testclient")
    from bestiary.core.serve.app import ServeSettings, create_app

    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(i): 50.0 for i in digit_ids}}
    with testclient.TestClient(create_app(llm, ServeSettings(served_model_name="m"))) as client:
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        banned = client.post("/v1/completions", json=body | {"logits_processors": ["ban_digits"]})
        unknown = client.post("/v1/completions", json=body | {"logits_processors": [{"name": "nope"}]})
    expected = llm.generate([PROMPT], [greedy(embedding_bias={i: 50.0 for i in digit_ids},
                                              logits_processors=["ban_digits"])])[0].text
    assert any(c in DIGITS for c in plain)
    assert banned.status_code == 200 and banned.json()["choices"][0]["text"] == expected
    assert not any(c in DIGITS for c in expected)
    assert unknown.status_code == 400 and "unknown processor 'nope'" in unknown.json()["error"]["message"]


def test_the_docs_show_the_plugin_files_as_they_are():
    doc = (PLUGIN_DIR.parents[2] / "docs" / "logits-processors.md").read_text()
    for path, lang in (("pyproject.toml", "toml"), ("bestiary_ban_digits/__init__.py", "python")):
        block = f"### `{path}`\n\n"
        start = doc.index(block)
        body = doc[doc.index(f"```{lang}\n", start) + len(lang) + 4: doc.index("```\n", doc.index(f"```{lang}\n", start) + 4)]
        assert body == (PLUGIN_DIR / path).read_text(), f"docs/logits-processors.md's {path} differs from the plugin"
