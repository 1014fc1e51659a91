"""The calibrated modes' perplexity gates of test_quant_smollm2 (its MODES, gates and reasons), in a file of their
own: GPTQ int4 (W4A16 g64 and g128), FP8, SmoothQuant and W4A8_AWQ.

They share one run of the float model over the calibration tokens (the module's `one_calibration_run`:
core.convert.calibration.shared_calibration), so they are in one file: `make test-slow`'s workers take whole
files (--dist loadfile) and a run is shared within a process only. The GPTQ gates then tune their group scales
end to end (core.convert.tune: 40 forward + backward passes of the float model), 12-16 min each on one CI
thread: this file keeps one worker ~33 min while the other runs every other slow file (tests/conftest.py FIRST
starts it first).
"""

from __future__ import annotations

import pytest
from test_quant_smollm2 import CALIBRATED_MODES, MODES, check_gate, fp32_ppl, one_calibration_run, workdir

pytestmark = pytest.mark.slow

FIXTURES = (fp32_ppl, one_calibration_run, workdir)  # used by name: imported so that this module has them


@pytest.mark.parametrize("quant,gate", [MODES[m] for m in CALIBRATED_MODES], ids=list(CALIBRATED_MODES))
def test_calibrated_perplexity_increase_within_gate(quant, gate, workdir, fp32_ppl, request):
    check_gate(request.node.callspec.id, quant, gate, workdir, fp32_ppl)
