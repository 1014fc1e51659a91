"""The conformance suite: `conformance(architecture, cases)` returns a pytest test class.

For each case (a tiny config) the class builds the reference's random source once, converts it
(tp 1) and loads the engine, then checks, each as its own test:

    logits      prefill + `steps` greedy decode steps vs the reference: max|d| <= 1e-4 max(1, max|ref|)
    broken      positions after the first moved by one must miss that bound by 100x (the test can fail;
                skipped for ALiBi, which reads no position ids)
    greedy      `LLM.generate` greedy tokens == the reference's argmax chain (up to a near-tie)
    tp_pp       a tp 2 x pp 2 convert reassembles to the tp 1 tensors exactly (as Supports allows)
    strict      an extra source tensor and a missing one are WeightsErrors naming the tensor
    quantized   a W8A16 convert runs, differs from the float logits, by at most 20% of their range
    cpu_plan    decode steps run as the compiled CPU plan, unless the model says why not (skip)
    linter      `convert --dry_run` finds nothing to flag in the correct plugin

The registry is the installed plugins plus the plugins the nearest pyproject.toml above the test file
declares that are not themselves installed; those win over an installed architecture of the same name
(bestiary.testing.local_plugins.local_registry).
"""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch

if TYPE_CHECKING:
    from bestiary.core.runtime.engine import Engine
    from bestiary.registry import Registry
    from bestiary.testing.references import Reference

PROMPT = [3, 17, 42, 5, 88, 9, 61, 23, 7, 70, 11, 34]


@dataclass
class Case:
    """One prepared case: the reference, its source, the tp 1 checkpoint and engine."""

    name: str
    reference: Reference
    source: Path
    checkpoint: Path
    engine: Engine
    registry: Registry
    workdir: Path


@dataclass(frozen=True)
class SuiteConfig:
    """What `conformance(...)` was given, normalized; the tests of the class it returns read it."""

    architecture: str
    cases: dict[str, Any]  # name -> an HF config object, a dict with `model_type`, or a reference
    registry: Registry | None  # None: the installed plugins + the test package's own (local_registry)
    prompt: list[int]
    steps: int
    quant_algo: str


def reference_chain(reference: Reference, prompt: list[int],
                    steps: int) -> tuple[list[int], list[torch.Tensor], int | None]:
    """The reference's greedy continuation of `prompt`: tokens, last-position logits [V] of each step, and
    the first step whose top-2 margin is under 1e-3 max|logit| (None: no near-tie)."""
    seq, tie = list(prompt), None
    rows: list[torch.Tensor] = []
    for step in range(steps):
        last = reference.logits(seq)[-1]  # [V]
        top2 = last.topk(2).values
        if tie is None and (top2[0] - top2[1]).item() < 1e-3 * last.abs().max().item():
            tie = step
        rows.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt):], rows, tie


def copy_source_with(source: Path, out: Path,
                     change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """`source` (a directory of .safetensors + side files) copied to `out`, its tensors passed through
    `change(dict) -> dict` and written to one model.safetensors."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.iterdir()):
        if path.suffix == ".safetensors":
            tensors.update(load_file(str(path)))
        elif path.is_file() and not path.name.endswith(".index.json"):
            shutil.copy(path, out / path.name)
    save_file({k: v.contiguous() for k, v in change(tensors).items()}, str(out / "model.safetensors"))
    return out


def prepare_case(suite: SuiteConfig, request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Case:
    """The `case` fixture of a conformance class: case `request.param`'s reference saved as a source,
    converted (tp 1) and loaded, with `suite.registry` or else the test file's local registry."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.local_plugins import local_registry
    from bestiary.testing.references import as_reference

    architecture, cases, registry = suite.architecture, suite.cases, suite.registry
    reg = registry or local_registry(request.path)
    reg.get(architecture)  # an unknown architecture fails here, naming the registered ones
    workdir = tmp_path_factory.mktemp(f"conformance_{request.param}")
    reference = as_reference(cases[request.param])
    source = reference.save(workdir / "source")
    ckpt = convert(source, workdir / "ckpt", registry=reg, show_progress=False)
    engine = Engine.load(ckpt, registry=reg)
    assert engine.config.architecture == reg.get(architecture).name, "converted as another architecture"
    return Case(request.param, reference, source, ckpt, engine, reg, workdir)


class ConformanceTests:
    """The suite's tests. `conformance()` returns a subclass with its `suite` and a class-scoped `case`
    fixture parametrized over the suite's cases (this base class has no Test prefix: never collected)."""

    suite: ClassVar[SuiteConfig]

    def test_logits(self, case: Case) -> None:
        """Prefill + `steps` greedy decode steps match the reference within 1e-4 max(1, max|ref|)."""
        diff, scale = self._diffs(case, position_shift=0)
        bound = 1e-4 * max(1.0, scale)
        if diff > bound:  # what the linter finds: a transposed tensor, the first layer that departs, a field
            from bestiary.core.convert.lint import lint

            found = lint(case.source, registry=case.registry).problems()
            pytest.fail(f"{case.name}: max|ours - reference| {diff:.3e} > {bound:.3e}; the linter: "
                        + ("; ".join(found) or "nothing (run `bestiary convert --dry_run` on the source)"))

    def test_broken_positions_miss(self, case: Case) -> None:
        """Positions after the first moved by one miss that bound by 100x (skipped for ALiBi)."""
        if case.engine.config.position_embedding_type in ("alibi", "alibi_with_scale"):
            pytest.skip("ALiBi reads no position ids: its bias comes from each key's place in the cache")
        diff, scale = self._diffs(case, position_shift=1, decode_steps=2)
        assert diff > 100 * 1e-4 * max(1.0, scale), f"{case.name}: shifted positions went unnoticed ({diff:.3e})"

    def test_greedy(self, case: Case) -> None:
        """`LLM.generate`'s greedy tokens equal the reference's argmax chain (up to a near-tie)."""
        from bestiary.core.runtime.llm import LLM
        from bestiary.core.runtime.sampling import SamplingConfig
        from bestiary.testing.parity import greedy_mismatch

        prompt, steps = self.suite.prompt, self.suite.steps
        ref, _, tie = reference_chain(case.reference, prompt, steps)
        llm = LLM(case.checkpoint, registry=case.registry)
        (out,) = llm.generate([prompt], SamplingConfig(max_new_tokens=steps, temperature=0.0, ignore_eos=True))
        assert greedy_mismatch(out.output_ids, ref, tie) is None, greedy_mismatch(out.output_ids, ref, tie)

    def test_tp_pp_reassembles(self, case: Case) -> None:
        """A tp 2 x pp 2 convert (as Supports allows) reassembles to the tp 1 tensors exactly."""
        from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
        from bestiary.core.format.checkpoint import load_rank_weights
        from bestiary.testing.parity import reassemble_checkpoint

        architecture = self.suite.architecture
        supports = case.registry.get(architecture).supports
        tp, pp = (2 if supports.tensor_parallel else 1), (2 if supports.pipeline_parallel else 1)
        if tp * pp == 1:
            pytest.skip(f"{architecture} declares neither tensor nor pipeline parallelism")
        split = convert(case.source, case.workdir / f"tp{tp}pp{pp}", ConvertOptions(tp_size=tp, pp_size=pp),
                        registry=case.registry, show_progress=False)
        whole = load_rank_weights(case.checkpoint, 0)
        if "lm_head.weight" not in whole and case.engine.model.tie_word_embeddings:
            whole["lm_head.weight"] = whole["transformer.vocab_embedding.weight"]  # tied: stored once on tp 1
        joined = reassemble_checkpoint(split, case.registry)
        assert sorted(joined) == sorted(whole)
        for key, tensor in whole.items():
            assert torch.equal(joined[key], tensor), f"{key}: tp {tp} x pp {pp} shards differ from tp 1"

    def test_strict_keys(self, case: Case, tmp_path: Path) -> None:
        """An extra and a missing source tensor are WeightsErrors naming the tensor."""
        from bestiary.core.convert.source_to_checkpoint import convert
        from bestiary.core.format.errors import WeightsError

        architecture = self.suite.architecture
        extra = copy_source_with(case.source, tmp_path / "extra",
                                 lambda w: w | {"conformance_extra.weight": torch.ones(3)})
        with pytest.raises(WeightsError, match="conformance_extra.weight"):
            convert(extra, tmp_path / "ckpt_extra", registry=case.registry, show_progress=False)
        ignored = case.registry.get(architecture).ignored_source_keys
        dropped = next(k for k in sorted(case_weights_keys(case.source), reverse=True)
                       if not any(fnmatch.fnmatchcase(k, glob) for glob in ignored))
        missing = copy_source_with(case.source, tmp_path / "missing",
                                   lambda w: {k: v for k, v in w.items() if k != dropped})
        with pytest.raises(WeightsError, match=dropped.replace(".", r"\.")):
            convert(missing, tmp_path / "ckpt_missing", registry=case.registry, show_progress=False)

    def test_quantized_smoke(self, case: Case) -> None:
        """A `quant_algo` convert runs and differs from float by at most 20% of the logit range."""
        from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
        from bestiary.core.format.config import QuantConfig
        from bestiary.core.runtime.engine import Engine
        from bestiary.registry import capabilities
        from bestiary.testing.parity import EngineRunner

        architecture, quant_algo, prompt = self.suite.architecture, self.suite.quant_algo, self.suite.prompt
        spec = case.registry.get(architecture)
        if quant_algo not in capabilities.quant_algos(spec):
            pytest.skip(f"{architecture} does not support {quant_algo}")
        ckpt = convert(case.source, case.workdir / f"q_{quant_algo}",
                       ConvertOptions(quantization=QuantConfig(quant_algo=quant_algo)),
                       registry=case.registry, show_progress=False)
        engine = Engine.load(ckpt, registry=case.registry)
        ours = EngineRunner(engine).feed(prompt, all_logits=True)
        ref = case.reference.logits(prompt)
        diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
        assert torch.isfinite(ours).all() and 0.0 < diff <= 0.2 * max(1.0, scale), (
            f"{case.name} {quant_algo}: max|diff| {diff:.3e} vs logit range {scale:.3e}")

    def test_cpu_decode_plan(self, case: Case) -> None:
        """Decode steps run as the compiled CPU plan, or the test skips naming why not."""
        from bestiary.core.kernels.cpu.build import library
        from bestiary.testing.parity import EngineRunner

        prompt = self.suite.prompt
        if library() is None:
            pytest.skip("the CPU kernels are not built here")
        runner = EngineRunner(case.engine)
        runner.feed(prompt)
        runner.feed([1])  # one decode step: builds the plan if the model allows one
        reason = case.engine.model.decode_plan_status()
        if reason is not None:
            pytest.skip(f"CPU decode steps run eagerly: {reason}")
        plans = case.engine.model.__dict__.get("_decode_plans", {})
        assert any(p is not None for p in plans.values()), "no refusal reason, yet no compiled plan ran"

    def test_linter_is_clean(self, case: Case) -> None:
        """`convert --dry_run` flags nothing in the correct plugin."""
        from bestiary.core.convert.lint import lint

        report = lint(case.source, registry=case.registry)
        assert report.problems() == [], "\n".join(report.problems())

    def _diffs(self, case: Case, position_shift: int, decode_steps: int | None = None) -> tuple[float, float]:
        """(max |ours - reference|, max |reference|) over the prefill and greedy decode steps."""
        from bestiary.testing.parity import reference_diffs

        prompt, steps = self.suite.prompt, self.suite.steps
        n = steps if decode_steps is None else decode_steps
        return reference_diffs(case.engine, case.reference.logits, prompt, n, position_shift)


def conformance(architecture: str, cases: Any, *, registry: Any = None, prompt: list[int] | None = None,
                steps: int = 6, quant_algo: str = "W8A16") -> type[ConformanceTests]:
    """A pytest test class running the suite on `architecture` for each case.

    cases: {name: case} or one case; a case is an HF config object, a dict with `model_type`
    (transformers.AutoConfig.for_model), or a reference (`HFReference`, `FunctionReference`).
    registry: default: the installed plugins + the test package's own not-installed ones, which win
    (see the module doc).
    """
    named = cases if isinstance(cases, dict) and "model_type" not in cases else {"default": cases}
    suite_config = SuiteConfig(architecture, named, registry, list(prompt or PROMPT), steps, quant_algo)

    class Conformance(ConformanceTests):
        """Conformance of one architecture (bestiary.testing.suite)."""

        suite = suite_config

        @pytest.fixture(scope="class", params=sorted(suite_config.cases))
        @classmethod
        def case(cls, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
            # a classmethod: pytest 10 drops instance-method fixtures
            return prepare_case(cls.suite, request, tmp_path_factory)

    Conformance.__name__ = Conformance.__qualname__ = f"TestConformance_{architecture}"
    return Conformance


def case_weights_keys(source: Path) -> list[str]:
    """Tensor names of a source directory's .safetensors files."""
    from safetensors import safe_open

    keys: list[str] = []
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            keys += list(f.keys())
    return keys
