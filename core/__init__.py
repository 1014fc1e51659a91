"""bestiary.core: the engine, in layers; each package imports only the layers below its own.

    format                     what checkpoint and engine dirs hold; errors, cache, progress
    plugins, sources, kernels  hook specs; reading model files; every op (Triton, C, torch)
    registry, layers           the architecture registry; the torch modules a model is built from
    quant, lora                quantized weights / KV caches; LoRA adapters
    runtime                    the model, engine loading, executor, sampling, the Python API (LLM)
    convert                    sources -> checkpoint -> engine (`bestiary convert`, `bestiary build`)
    bench, serve               `bestiary bench`; the OpenAI-compatible server
    cli, testing               the `bestiary` command; the conformance kit (bestiary.testing)

docs/architecture.md draws the map, how a request flows through it and the reading order of the
forward pass; tests/test_layout.py enforces the rules.
"""
