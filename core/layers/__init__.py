"""bestiary.core.layers: the torch modules a model is built from (the plugin API of docs/add-an-architecture.md).

Linear (tensor-parallel roles, a quantized `quant` slot, the step's LoRA delta), Embedding, norms,
MLPs, MoE, rotary / ALiBi positions, the attention op (`attention.PagedAttention`), self-attention,
the decoder layers (pre-norm, parallel, post-norm, output-norm) and `standard_layer`, the builder of
a family's layer from its config. Every op goes through core.kernels.dispatch.

Layer 2 of the core (docs/architecture.md). May import: format, plugins, sources, kernels.
"""
