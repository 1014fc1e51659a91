"""The int32 word layouts of HF 4-bit AWQ and GPTQ checkpoints, and their canonical form.

K in-features, N out-features, G the source's group size (-1: one group over all of K),
groups = ceil(K / G). Nibble j of an int32 word is bits 4j..4j+3 (j = 0 the lowest).

AWQ (AutoAWQ "gemm", what transformers loads):
    qweight int32 [K, N/8]      nibble j of word [k, c] = q[k, 8c + AWQ_ORDER[j]]
    qzeros  int32 [groups, N/8] same order, z[g, n] as is
    scales        [groups, N]
    w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7): columns 0..7 sit in nibbles 0, 4, 1, 5, 2, 6, 3, 7.

GPTQ (AutoGPTQ, GPTQModel, optimum):
    qweight int32 [K/8, N]      nibble j of word [r, n] = q[8r + j, n]   (packed along K)
    qzeros  int32 [groups, N/8] nibble j of word [g, c] = z[g, 8c + j] - zero_offset
                                (zero_offset 1 in "gptq" (v1) checkpoints, 0 in "gptq_v2")
    scales        [groups, N]
    g_idx   int32 [K]           group of in-feature k: k // G, or any grouping (act-order, desc_act)
    w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    A v1 zero of 0 is stored as 15 and reads back as 16, as in the reference kernels; the
    canonical layout holds zeros as floats, so (q - 16) * s is kept exactly.

Canonical form (core.format.packing, W4A16 with zero points): codes [N, K] with groups of
G_c contiguous in-features. Act-order is made group-contiguous by a permutation of the
in-features: perm = the stable argsort of g_idx, codes[:, j] = q[perm[j], :], so that
canonical feature j is source feature perm[j] and its group is j // G. The layer then
multiplies x[..., perm] (core.quant.slot applies it). G_c is the largest of 128, 64, 32
dividing G (128 for G = -1); each canonical group lies inside one source group, whose
scale and zero it repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j]
AWQ_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of an AWQ word sits in nibble AWQ_INVERSE[c]
CANONICAL_GROUPS = (128, 64, 32)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> uint8 [..., W, 8]: nibble j of each word."""
    return ((words.to(torch.int32)[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [K, N/8] or qzeros [groups, N/8] -> uint8 [K or groups, N] in column order."""
    return nibbles(words)[..., list(AWQ_INVERSE)].reshape(words.shape[0], -1)


def unpack_gptq_qweight(words: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] -> codes uint8 [K, N] (nibble j of row r is in-feature 8r + j)."""
    n = nibbles(words)  # [K/8, N, 8]
    return n.permute(0, 2, 1).reshape(-1, words.shape[1])


def unpack_gptq_qzeros(words: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros [groups, N/8] -> stored zeros uint8 [groups, N] (nibble j of word c is column 8c + j)."""
    return nibbles(words).reshape(words.shape[0], -1)


def canonical_group(group_size: int) -> int:
    """The canonical group size for a source group size (-1: per output channel)."""
    if group_size == -1:
        return CANONICAL_GROUPS[0]
    for g in CANONICAL_GROUPS:
        if group_size % g == 0:
            return g
    raise ValueError(f"group_size {group_size}: expected -1 or a multiple of 32")


def act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """g_idx [K] -> perm int32 [K] (stable argsort) with g_idx[perm[j]] == j // G for every j.

    Raises ValueError when the groups are not G consecutive features once sorted (every group
    but the last full), the only grouping the canonical layout can hold."""
    k = g_idx.shape[0]
    g = k if group_size == -1 else group_size
    g_idx = g_idx.to(torch.int64)
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(k) // g):
        raise ValueError(f"its groups are not {g} input features each")
    return perm.to(torch.int32)


@dataclass
class Canonical:
    """One layer in the canonical W4A16 layout (before int4 packing)."""

    codes: torch.Tensor  # uint8 [N, K], canonical (group-contiguous) feature order
    scales: torch.Tensor  # [N, ceil(K / G_c)], the source's dtype
    zeros: torch.Tensor  # float32 [N, ceil(K / G_c)]
    perm: torch.Tensor  # int32 [K]: canonical feature j is source in-feature perm[j]


def to_canonical(
    q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, perm: torch.Tensor, group_size: int
) -> Canonical:
    """Source codes q [K, N], zeros z [groups, N], scales s [groups, N] (groups of the sorted
    features, see act_order_perm) -> the canonical layer with groups of canonical_group(G)."""
    k = q.shape[0]
    g_src = k if group_size == -1 else group_size
    g_c = canonical_group(group_size)
    groups_c = -(-k // g_c)
    src_group = torch.arange(groups_c) * g_c // g_src  # [groups_c]: the source group holding each
    codes = q[perm.long()].t().contiguous()  # [N, K]
    return Canonical(codes, s[src_group].t().contiguous(), z[src_group].t().float().contiguous(), perm)
