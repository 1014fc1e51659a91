"""ConvertOptions: the flags checked when the options are made, with the CLI's one-line errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bestiary.core.convert.source_to_checkpoint import ConvertOptions
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import BestiaryError, ConfigError


@pytest.mark.parametrize("fields, error, message", [
    ({"dtype": "int8"}, BestiaryError, "--dtype 'int8': expected auto, float32, float16 or bfloat16"),
    ({"tp_size": 0}, BestiaryError, "--tp_size 0: expected a positive integer"),
    ({"pp_size": -1}, BestiaryError, "--pp_size -1: expected a positive integer"),
    ({"moe_ep_size": 0}, BestiaryError, "--moe_ep_size 0: expected a positive integer"),
    ({"tp_size": 2, "moe_ep_size": 3}, BestiaryError,
     "--moe_ep_size 3: moe_tp_size * moe_ep_size must equal --tp_size 2"),
    ({"use_parallel_embedding": True, "embedding_sharding_dim": 2}, BestiaryError,
     "--embedding_sharding_dim 2: expected 0 (vocab) or 1 (hidden)"),
    ({"weight_quantizer": "awq"}, ConfigError, "--weight_quantizer 'awq': expected one of rtn, gptq"),
    ({"tune_steps": -1}, ConfigError, "--tune_steps -1: expected 0 (no tuning) or a positive number of steps"),
    ({"smoothquant_alpha": 1.5}, ConfigError,
     "--smoothquant 1.5: expected a migration strength alpha with 0 < alpha <= 1"),
])
def test_a_bad_flag_is_the_clis_one_line_error(fields, error, message):
    with pytest.raises(error) as info:
        ConvertOptions(**fields)
    assert str(info.value) == message


def test_defaults_and_good_values_pass():
    assert ConvertOptions().dtype == "auto" and ConvertOptions().mapping().world_size == 1
    options = ConvertOptions(dtype="bf16", tp_size=4, pp_size=2, moe_tp_size=2,
                             quantization=QuantConfig(quant_algo="W8A16"), smoothquant_alpha=1.0)
    mapping = options.mapping()
    assert (mapping.moe_tp_size, mapping.moe_ep_size, mapping.world_size) == (2, 2, 8)
    ConvertOptions(embedding_sharding_dim=5)  # only checked with use_parallel_embedding (as the CLI did)


def test_unknown_fields_are_refused_and_options_are_frozen():
    with pytest.raises(ValidationError, match="tp"):
        ConvertOptions(tp=2)
    with pytest.raises(ValidationError):
        ConvertOptions().tp_size = 2  # frozen: derive variants with model_copy / tp1


def test_tp1_keeps_everything_but_the_split():
    quant = QuantConfig(quant_algo="W4A16", group_size=32)
    options = ConvertOptions(dtype="float16", tp_size=4, pp_size=2, moe_ep_size=2, quantization=quant,
                             calib_text="calib.txt", use_parallel_embedding=True)
    whole = options.tp1(weight_quantizer="gptq", tune_steps=3)
    assert (whole.tp_size, whole.pp_size, whole.moe_tp_size, whole.moe_ep_size) == (1, 1, None, None)
    assert whole.mapping().world_size == 1
    assert whole.model_dump(exclude={"tp_size", "pp_size", "moe_ep_size", "weight_quantizer", "tune_steps"}) == \
        options.model_dump(exclude={"tp_size", "pp_size", "moe_ep_size", "weight_quantizer", "tune_steps"})
    assert (whole.weight_quantizer, whole.tune_steps) == ("gptq", 3)
    assert whole.quantization is quant


def test_a_rank_count_past_max_ranks_is_one_line():
    """`convert --pp_size 1000000000` was an internal error (a pydantic ValidationError; fuzz seed 7 case 849)."""
    from bestiary.core.convert.options import ConvertOptions
    from bestiary.core.format.errors import BestiaryError

    with pytest.raises(BestiaryError, match="--pp_size 1000000000: expected a positive integer of at most 65536"):
        ConvertOptions(pp_size=10**9)
    with pytest.raises(BestiaryError, match="more than 65536 ranks"):
        ConvertOptions(tp_size=512, pp_size=512)
