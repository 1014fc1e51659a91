"""lm-evaluation-harness 0.4.9 imported under transformers 5, and the parts of it the bestiary model uses.

lm-eval 0.4.9's model modules (all imported by `import lm_eval`) read
`transformers.AutoModelForVision2Seq`, which transformers 5 removed (its successor is
AutoModelForImageTextToText): importing lm-eval then fails with an AttributeError. The alias is set
when it is missing, after `evaluate` is imported (importing it swaps the `transformers` module object
in sys.modules, which would drop an alias set before). Nothing else of transformers is changed.
"""

from __future__ import annotations

import evaluate  # noqa: F401 - first: see the module docstring
import transformers

if not hasattr(transformers, "AutoModelForVision2Seq"):
    transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText  # type: ignore[attr-defined]

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import MODEL_REGISTRY  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

__all__ = ["MODEL_REGISTRY", "Instance", "TemplateLM", "get_rolling_token_windows", "handle_stop_sequences",
           "lm_eval", "make_disjoint_window"]
