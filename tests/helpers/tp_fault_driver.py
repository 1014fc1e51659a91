"""A driver process for the fault tests: LLM(checkpoint) on its ranks, then a long streamed generation.

Run as `python tp_fault_driver.py CKPT [--hang_on_interrupt]`; prints "ranks PID..." once the ranks are up and
"token" lines as tokens arrive (the test kills a rank mid-generation).
"""

from __future__ import annotations

import sys
import threading


def main() -> None:
    import torch

    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], num_threads=1)
    pids = [s.process.pid for s in llm.engine.group.spawned]
    print("ranks", *pids, flush=True)
    sampling = SamplingConfig(temperature=0, max_new_tokens=32, ignore_eos=True)
    try:
        while True:
            for _ in llm.generate_stream([1, 2, 3], sampling):
                print("token", flush=True)
    except KeyboardInterrupt:
        if "--hang_on_interrupt" in sys.argv:  # cleanup that never ends: the Ctrl-C deadline must end it
            threading.Event().wait()
        raise


if __name__ == "__main__":
    main()
