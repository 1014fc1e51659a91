"""A rank file's tensors into a model on the meta device: checked, assigned, and prepared a layer at a time.

`Engine.load` on the CPU reads layer i's tensors (core.format.safetensors_stream: memory of their own,
64-byte aligned, each checked finite), assigns them to layer i, and prepares that layer at once
(DecoderLM.prepare_for_inference(part): tiles, transposes, quantized layouts), so its sources are freed
before layer i + 1 is read; the tensors outside the layers (embedding, final norm, lm_head) come last.
The load's high-water mark is then the prepared model plus about one layer and the largest tensor
(a tied embedding, repacked last) and at most TRIM_AFTER of freed heap, not every tensor as read plus
every repack. (Handing the freed heap back after every layer, malloc_trim, made a 135M model's load 35%
slower, as the next layer faulted the pages in again; Engine.load trims once more at the end.) Before any tensor is read, the file's
names and dtype kinds are checked against the model's (`check_rank_tensors`): one line for the first
missing, unexpected or mistyped tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bestiary.core.format.checkpoint import check_finite
from bestiary.core.format.errors import WeightsError
from bestiary.core.format.safetensors_stream import SafetensorsStream
from bestiary.core.kernels.cpu.malloc import release_freed_memory

# Freed heap (bytes) a load may leave resident before handing it back mid-load: the sources the layouts
# replace are freed in malloc's arenas (those of the threads that made them), which later layers reuse
# only in part (a 1.1B bf16 load's peak varied 1.12-1.33x the final model without a bound).
TRIM_AFTER = 256 << 20


def check_rank_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.dtype], where: str) -> None:
    """The rank file holds exactly the model's tensors (`found`: name -> dtype), each a float where the model
    holds a float and an integer where it holds codes (an int32 lm_head would fail in the first matmul):
    else one line."""
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or unexpected:
        what = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {unexpected[0]!r}"
        raise WeightsError(f"{where}: {what}")
    for name, want in expected.items():
        got = found[name]
        if got.is_floating_point != want.is_floating_point() or (got == torch.bool) != (want.dtype == torch.bool):
            raise WeightsError(f"{where}: tensor {name!r} is {str(got).removeprefix('torch.')}, "
                               f"expected {str(want.dtype).removeprefix('torch.')}")


def assign(module: nn.Module, tensors: dict[str, torch.Tensor], where: str, strict: bool = True,
           prefix: str = "") -> list[str]:
    """module.load_state_dict(tensors, assign=True): a size mismatch is one WeightsError line naming the tensor
    by its key in the file (`prefix`: the module's path in the model); returns the module's keys `tensors`
    left out (none when strict)."""
    try:
        return module.load_state_dict(tensors, strict=strict, assign=True).missing_keys
    except RuntimeError as err:
        line = str(err).splitlines()[-1].strip().replace("size mismatch for ", f"size mismatch for {prefix}", 1)
        raise WeightsError(f"{where}: {line}") from None


def load_by_layer(model, path: Path, allow_nonfinite: bool = False) -> None:
    """Read, assign and prepare `model`'s tensors from rank file `path`, layer by layer (module docstring);
    `model.prepare_for_inference()` then prepares the rest."""
    expected = model.state_dict()  # meta tensors: names, shapes, dtypes
    where = str(path)
    if not path.is_file():
        raise WeightsError(f"{path}: rank file not found")
    with SafetensorsStream(path) as stream:
        check_rank_tensors(expected, {name: entry.dtype for name, entry in stream.entries.items()}, where)

        def read(names: list[str], prefix: str = "") -> dict[str, torch.Tensor]:
            out = {}
            for name in names:
                out[name[len(prefix):]] = tensor = stream.get_tensor(name)
                if not allow_nonfinite:
                    check_finite(tensor, f"{where}: tensor {name!r}")
            return out

        by_id = {id(module): name for name, module in model.named_modules()}  # a layer's path in the model
        placed: set[str] = set()
        read_since = 0  # bytes read since freed heap was last looked at (glibc's account costs ~4 ms)
        for layer in model.transformer.layers:
            prefix = by_id[id(layer)] + "."
            keys = [k for k in expected if k.startswith(prefix)]
            assign(layer, read(keys, prefix), where, prefix=prefix)
            model.prepare_for_inference(layer)  # its sources go as its layouts are made
            read_since += sum(stream.entries[k].nbytes for k in keys)
            if read_since >= TRIM_AFTER:  # hand back freed heap the next layers did not take, past TRIM_AFTER
                release_freed_memory(TRIM_AFTER)
                read_since = 0
            placed.update(keys)
        release_freed_memory()  # the layers' freed sources, before the largest tensor (the embedding) is read
        rest = [k for k in expected if k not in placed]
        missing = assign(model, read(rest), where, strict=False)
        if set(missing) - placed:  # check_rank_tensors found every name: only a model that names one twice
            raise WeightsError(f"{where}: tensor {sorted(set(missing) - placed)[0]!r} was not assigned")
