"""bestiary.core.runtime: an engine dir -> a model on this rank -> generated tokens.

`model` (the generic decoder LM), `engine` (loading an engine or checkpoint dir), `executor`
(in-flight batching), `kv_cache` (paged pools), `sampling`, `logits_processors`, `beam`,
`speculative`, `tokenizer`, `chat_template` (rendered as transformers does), `text_deltas`
(streamed text, stop strings), `llm` (the Python API), `evaluate` (perplexity), `cpu_plan` (a CPU
decode step as one compiled plan), `cuda_graph` (a CUDA decode step as one graph), `pipeline`,
`worker_group` and `step_broadcast` (several ranks).
One upward edge, lazy and listed in tests/test_layout.py: `llm.ensure_engine` (`LLM(source)` on a
source that is not an engine dir) imports convert inside that function.

Layer 4 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora.
"""
