"""`make mutation`: mutmut on the numerics-heavy modules, one module at a time (not run in CI).

mutmut copies the code it mutates into ./mutants and imports it from there, so it needs the
package under its import name: each run works in a staging directory `.mutation/<name>/` holding
a copy of the repository as `bestiary/` and a setup.cfg naming the module and its fast tests.
The score per module goes to `.mutation/scores.txt`; survivors are listed by
`cd .mutation/<name> && mutmut results` and `mutmut show <mutant>`. docs/testing.md lists the
survivors of the last full run with the reason each one stays.

    python tests/mutation_run.py [name ...]     (default: every module below but `layers`)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / ".mutation"

# every family's tiny-model parity with transformers (prefill and decode), the attention paths,
# windows, MoE, fusion, chunked prefill and TP reassembly; not the AVX2/AVX-512 decode builds (a
# C++ compile per forked run; the scalar one stays) nor test_layout (import rules, no numerics)
LAYER_FILES = [
    "tests/models/test_llama_parity.py", "tests/layers/test_cpu_matmul.py", "tests/models/test_zoo_hf.py",
    "tests/layers/test_decode_attention.py", "tests/models/test_opt.py", "tests/models/test_falcon.py", "tests/models/test_chatglm.py",
    "tests/models/test_mixtral.py",
    "tests/runtime/test_attention_window.py", "tests/quant/test_quant_fuse.py", "tests/convert/test_fused_qkv_hooks.py",
    "tests/format/test_checkpoint.py", "tests/runtime/test_executor.py::test_mixed_workload_equals_each_alone",
    "tests/layers/test_mutation_kills_layers.py", "tests/layers/test_mutation_kills_mlp_matmul.py",
    "tests/layers/test_mutation_kills_rotary_window.py",
]
LAYER_FLAGS = ["-m", "not slow", "-k", "not avx2 and not avx512"]
LAYER_TESTS = LAYER_FILES + LAYER_FLAGS
# the position, norm, MLP and window files of core/layers (820 of its ~2,900 mutants): what a
# shared 2-core machine runs in under an hour; `layers` is the whole folder
LAYERS_NUMERICS = [f"core/layers/{f}.py" for f in (
    "rotary", "rotary_2d", "alibi", "position_embedding", "norm", "mlp", "cpu_matmul")] + [
    "core/kernels/attention_window.py"]
LAYERS_ATTENTION = [f"core/layers/{f}.py" for f in (
    "attention", "self_attention", "decoder_layer", "builder", "output_norm_decoder_layer",
    "parallel_decoder_layer", "post_norm_decoder_layer")] + ["core/kernels/attention_ref.py", "core/kernels/metadata.py"]
LAYERS_LINEAR_MOE = [f"core/layers/{f}.py" for f in ("linear", "embedding", "moe")]
# the layer tests, and what reaches the attention paths the model parity tests never take (dense references
# of every path, quantized KV pools, LoRA through each decoder layer)
ATTENTION_TESTS = LAYER_FILES + [
    "tests/layers/test_mutation_kills_attention.py", "tests/quant/test_quant_kv.py", "tests/lora/test_lora.py"] + LAYER_FLAGS
# the layer tests, the LoRA rows and weight-only / activation quant linears. Not test_moe_ep.py: an engine
# with ranks in a forked mutant run spins until its CPU limit (a "timeout" whatever the mutant), so its
# tests run by hand, in fresh processes, on what the run leaves (docs/testing.md)
LINEAR_TESTS = LAYER_FILES + [
    "tests/layers/test_mutation_kills_linear_moe.py", "tests/lora/test_lora.py", "tests/lora/test_lora_rows.py", "tests/quant/test_quant.py",
    "tests/quant/test_quant_act.py"] + LAYER_FLAGS
# the op families (torch references and launchers; mutmut leaves the @triton.jit kernels alone),
# not dispatch.py: its CPU branches are what the layer tests run, its CUDA ones need a GPU
KERNEL_FAMILIES = [f"core/kernels/{f}.py" for f in (
    "activations", "activations_ref", "attention", "lora", "moe", "norms", "rotary", "sampling", "sampling_ref",
    "woq_gemm")]
KERNEL_TESTS = [f"tests/kernels/test_kernels_{f}.py" for f in (
    "norms", "rotary", "activations", "attention", "moe", "woq_gemm", "lora", "sampling", "dispatch",
    "attention_window")] + ["tests/kernels/test_mutation_kills_kernels.py",
                            "tests/kernels/test_mutation_kills_kernels_args.py"]
# reassembly, strict keys, q/k/v fan-out, Falcon's self-slicing MQA hook, Qwen2-MoE's layer key
# maps, GPT-2's buffers, non-finite weights, the streamed (row-block) convert
LOADER_TESTS = [
    "tests/format/test_checkpoint.py", "tests/convert/test_tp_fanout.py", "tests/convert/test_mutation_kills_loader.py",
    "tests/models/test_falcon.py", "tests/models/test_opt.py::test_tp2_pp2_shards_reassemble_to_tp1",
    "tests/models/test_opt.py::test_unknown_and_missing_source_keys_fail_with_nearest_names",
    "tests/models/test_zoo_hf.py::TestQwen2Moe", "tests/models/test_zoo_hf.py::TestGPT2",
    "tests/cli/test_failures.py::test_nan_weights_are_refused_at_convert_and_at_load",
    "tests/cli/test_failures.py::test_fp16_overflow_at_convert_is_refused", "tests/convert/test_convert_memory.py",
    "-m", "not slow",
]

# name -> (module paths inside the package, the fast tests that cover them)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "sampling": (["core/runtime/sampling.py", "core/kernels/sampling_ref.py"], ["tests/runtime/test_sampling.py",
                                                "tests/runtime/test_mutation_kills_sampling.py",
                                                "tests/kernels/test_kernels_sampling.py",  # filter_logits_ref
                                                "tests/runtime/test_beam.py::test_beam_search_equals_hf_tiny"]),
    "beam": (["core/runtime/beam.py"], ["tests/runtime/test_beam.py", "-m", "not slow"]),
    "kv_cache": (["core/runtime/kv_cache.py"], ["tests/runtime/test_kv_pool.py", "tests/runtime/test_scheduler.py",
                                                "tests/quant/test_quant_kv.py",
                                                "tests/runtime/test_mutation_kills_kv_cache.py"]),
    "packing": (["core/format/packing.py"], ["tests/quant/test_quant.py", "-m", "not slow"]),
    "loader": (["core/convert/loader.py"], LOADER_TESTS),
    "kernels": (KERNEL_FAMILIES, KERNEL_TESTS),
    "layers_numerics": (LAYERS_NUMERICS, LAYER_TESTS),
    # how float matmuls run on the CPU (row tiles, the kernel's bound per build, upcasts): its own tests
    "cpu_matmul": (["core/layers/cpu_matmul.py"], ["tests/layers/test_cpu_matmul.py", "tests/layers/test_mutation_kills_mlp_matmul.py",
                                                   "-m", "not slow"]),
    # the rest of core/layers in two runs: the attention layer and the decoder layers that compose it
    # (25 min on 2 cores); the linears (TP splits, LoRA, weight-only), embeddings and MoE (over an hour:
    # every model test covers Linear.forward)
    "layers_attention": (LAYERS_ATTENTION, ATTENTION_TESTS),
    "layers_linear_moe": (LAYERS_LINEAR_MOE, LINEAR_TESTS),
    "layers": (["core/layers/"], LAYER_TESTS),
}


def single_threaded_env() -> dict[str, str]:
    """The environment for `mutmut run`: one OpenMP/MKL thread.

    mutmut forks each mutant's test run from a process that has already run torch; a fork of a
    process whose OpenMP thread pool is up deadlocks in the child's first parallel region, so
    every mutant would end as a CPU-time "timeout" (what the first full run showed). With one
    thread no pool is started and the forks run.

    TRITON_INTERPRET=1 from the start: mutmut runs pytest several times in one process (its
    collection, the clean run, then a fork per mutant), so tests/kernels/conftest.py finds the
    kernel modules of the previous run imported; with the variable set before the first import
    they were built for the interpreter, and the conftest lets them be."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


# Appended to the staged tests/conftest.py. mutmut runs every test once in its own process (the stats and
# clean runs), then forks that process per mutant; a test that sets torch's threads above 1 (the CLI's
# --num_threads, LLM(num_threads=2), a thread-split kernel test) leaves an OpenMP pool in it, and each forked
# run then spins in its first parallel region until its CPU limit: a "timeout" whatever the mutant.
ONE_THREAD = """

# tests/mutation_run.py: torch stays on one thread in mutation runs (see ONE_THREAD there)
import torch as _torch  # noqa: E402

_torch.set_num_threads = lambda n, _set=_torch.set_num_threads: _set(1)
"""


def stage(name: str) -> Path:
    """A fresh `.mutation/<name>/` with the repository as `bestiary/` and mutmut's setup.cfg."""
    paths, tests = MODULES[name]
    work = STAGE / name
    shutil.rmtree(work, ignore_errors=True)
    ignore = shutil.ignore_patterns(".git", ".mutation", "site", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, work / "bestiary", ignore=ignore)

    def listed(items: list[str]) -> str:  # setup.cfg lists: one item a line
        return "".join(f"\n    {item}" for item in items)

    with open(work / "bestiary" / "tests" / "conftest.py", "a") as f:
        f.write(ONE_THREAD)
    selection = [f"bestiary/{t}" if t.startswith("tests/") else t for t in tests]
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths ={listed([f'bestiary/{p}' for p in paths])}\n"
        f"also_copy ={listed(['bestiary/'])}\n"
        f"pytest_add_cli_args_test_selection ={listed(selection)}\n"
        f"pytest_add_cli_args ={listed(['-x', '-q', '-p', 'no:cacheprovider'])}\n"
    )
    return work


def score(work: Path) -> str:
    """'killed / total (percent)' from `mutmut results --all true`."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=False).stdout
    states = re.findall(r":\s*(\w[\w ]*)$", out, flags=re.MULTILINE)
    total, killed = len(states), sum(s == "killed" for s in states)
    return f"{killed} / {total} killed ({100 * killed / max(total, 1):.0f}%)"


def main(names: list[str]) -> int:
    STAGE.mkdir(exist_ok=True)
    for name in names or [n for n in MODULES if n != "layers"]:  # the whole of core/layers on request
        work = stage(name)
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2"], cwd=work, check=False,
                       env=single_threaded_env())
        line = f"{name}: {score(work)}"
        print(line)
        with open(STAGE / "scores.txt", "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
