"""bestiary.core.convert: sources -> checkpoint dir -> engine dir.

- `loader`: key maps, rank slices, strict loading (and the hook markers plugins use:
  `slices_itself`, `Target`); `postprocess`: shared postprocess hooks (`transposes_source`, ...).
- `source_to_checkpoint`: `bestiary convert` (`convert`, `ConvertOptions`, `instantiate`, `rank_writer`);
  `options`: `ConvertOptions`, what a conversion does (dtype, splits, quantization), checked when made;
  `checkpoint_to_engine`: `bestiary build` (`build_engine`); `lint`: the converted checkpoint checked.
- quantizing while converting: `quantize` (round to nearest as weights stream by),
  `calibration` (the float model over calibration tokens: linear input statistics),
  `quantize_calibrated` (GPTQ / AWQ / SmoothQuant with them), `tune` (end-to-end scale tuning),
  `kv_scales` (KV cache scales), `import_prequantized` (HF AWQ / GPTQ checkpoints as they are).
- `lora_convert`, `export_flm`, `flm_encode`, `flm_tables`: LoRA tensors and FastLLM .flm files.
- `progress` (rich progress bars on stderr), `memory` (what a build's limits need of this host).

Layer 5 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime.
"""
