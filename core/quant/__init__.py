"""bestiary.core.quant: how quantized weights and KV caches are held and run.

`modes` (which linear gets which quantization), `apply` (installs the slots when a model is built),
`slot` / `act_slot` (weight-only and activation-quantized Linear slots: packed tensors, matmul),
`fuse` (quantized fc + gate as one matmul), `online_act` (dynamic input quantization), `kv` (INT8 /
FP8 KV pools and their scales), `gptq`, `awq`, `awq_fold` (the data-aware quantizers' math on a
layer's input statistics, `input_stats`), `hf_formats` (HF AWQ / GPTQ word layouts), `options` (the
CLI flags), `calib_text` (the built-in calibration texts). Running a model over calibration text and
quantizing while converting are core.convert's (calibration, quantize, quantize_calibrated, tune,
import_prequantized, kv_scales).

Layer 3 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers.
"""
