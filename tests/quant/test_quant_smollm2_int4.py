"""The GPTQ int4 perplexity gates of test_quant_smollm2 (its MODES, gates and reasons), in a file of their own.

Each converts SmolLM2-135M with GPTQ and then tunes its group scales end to end (core.convert.tune: 40
forward + backward passes of the float model), 12-16 min each on one CI thread: `make test-slow`'s workers take
whole files (--dist loadfile), so these run on one worker while the other runs every other slow file
(tests/conftest.py FIRST starts both files first).
"""

from __future__ import annotations

import pytest
from test_quant_smollm2 import INT4_MODES, MODES, check_gate, fp32_ppl, one_calibration_run, workdir

pytestmark = pytest.mark.slow

FIXTURES = (fp32_ppl, one_calibration_run, workdir)  # used by name: imported so that this module has them


@pytest.mark.parametrize("mode", INT4_MODES)
def test_int4_perplexity_increase_within_gate(mode, workdir, fp32_ppl):
    quant, gate = MODES[mode]
    check_gate(mode, quant, gate, workdir, fp32_ppl)
