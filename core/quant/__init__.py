"""bestiary.core.quant: weight-only and activation quantization, packed layouts, KV cache quantization."""
