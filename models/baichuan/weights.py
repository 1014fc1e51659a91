"""Baichuan's own postprocess hook: Baichuan2's NormHead, applied once on convert."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def normalize_rows(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Postprocess of lm_head.weight [V_r, H]: W / ||W_v||_2 per row v (F.normalize) with NormHead, else as is."""
    (w,) = tensors
    return {key: F.normalize(w.float(), dim=1).to(w.dtype) if config.norm_head else w}
