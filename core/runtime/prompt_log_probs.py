"""Log probs of a prompt's own tokens (echo with logprobs, lm-eval's loglikelihood), from its context logits.

    log p(t_i | t_<i) = log_softmax(logits_{i-1})[t_i]     i = 1 .. P-1;  none for t_0 (nothing before it)

The raw model distribution (no temperature, penalties or top-k / top-p: those shape sampling, and a
prompt is not sampled), as vLLM's prompt_logprobs and OpenAI's echo give it.
"""

from __future__ import annotations

import torch


def prompt_log_probs(prompt: list[int], context_logits: torch.Tensor, top: int = 0
                     ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """(log p of each prompt token, None first; with `top` > 0 the `top` most likely tokens at each
    position, None first) from context_logits [P, V] of the P prompt positions."""
    logp = torch.log_softmax(context_logits.float(), dim=-1)  # [P, V]
    ids = torch.tensor(prompt[1:], dtype=torch.long)
    chosen = logp[:-1].gather(1, ids[:, None])[:, 0].tolist() if len(prompt) > 1 else []  # [P - 1]
    alternatives: list[list[tuple[int, float]] | None] = [None]
    if top > 0 and len(prompt) > 1:
        values, indices = logp[:-1].topk(top, dim=-1)  # [P - 1, top]
        alternatives += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        alternatives += [[] for _ in prompt[1:]]
    return [None, *chosen], alternatives
