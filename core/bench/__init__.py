"""bestiary.core.bench: what `bestiary bench` measures, on engines and on peer systems.

Three workloads (core.bench.workload): batch-1 decode, prefill (time to first token at several
prompt lengths) and a mixed workload of many requests submitted at once; and, when asked, an
input-grounded one on engines (core.bench.rewrite: rewrite a given text, where speculative
decoding by prompt lookup pays off). Each system under test (an engine, or a peer: HF
transformers, llama.cpp, FastLLM; core.bench.peers) answers the same calls; a peer whose package
or model file is missing is reported as skipped, with the reason.

Layer 6 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert.
"""
