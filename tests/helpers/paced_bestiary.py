"""`bestiary` (its script's entry) with LLM.generate_stream paced: one piece every $PACE_S seconds, so a
test's Ctrl-C or signal lands mid-answer whatever the machine's speed.

Run as `python paced_bestiary.py COMMAND FLAGS...` (tests/cli/test_chat_keys.py, test_stream_errors.py).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    from bestiary.core.cli import main as bestiary
    from bestiary.core.runtime import llm as llm_module

    real_stream = llm_module.LLM.generate_stream
    pace_s = float(os.environ["PACE_S"])

    def paced_stream(self, *args, **kwargs):
        pieces = real_stream(self, *args, **kwargs)
        try:
            for piece in pieces:
                time.sleep(pace_s)
                yield piece
        finally:
            pieces.close()  # a stopped answer cancels its request

    llm_module.LLM.generate_stream = paced_stream  # type: ignore[method-assign]
    return bestiary(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
