"""bestiary.core.runtime: an engine dir -> a model on this rank -> generated tokens.

`model` (the generic decoder LM), `engine` (loading an engine or checkpoint dir),
`executor` (in-flight batching), `kv_cache` (paged pools), `sampling`,
`logits_processors`, `beam`, `tokenizer`, `chat_template` (rendered as transformers does),
`text_deltas` (streamed text, stop strings), `llm` (the Python API), `evaluate` (perplexity).

Imports: format, layers, kernels, cpu, quant, registry, plugins; never convert, serve or cli.
One documented edge: `llm.ensure_engine` (used by `LLM(source)` on a non-engine source)
imports convert inside that one function.
"""
