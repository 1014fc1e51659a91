"""GPTQ (Frantar et al., 2022): int4 group-wise weights that minimise the layer's output error.

For a Linear y = x W^T (W [N, K]) with calibration inputs x_t, the output error of quantized
weights Q is

    E(Q) = sum_t |(W - Q) x_t|^2 = trace((W - Q) H (W - Q)^T),    H = sum_t x_t x_t^T [K, K]

(rows of W are independent: each row n sees the same H). GPTQ quantizes the columns k = 0..K-1
in order; after column k is rounded (q_k = quant(w_k)), the not-yet-quantized columns j > k
absorb its error so E stays minimal given q_0..q_k (Optimal Brain Surgeon with U the upper
Cholesky factor of H^-1, U^T U = H^-1):

    e   = (w_k - q_k) / U[k, k]               [N]
    w_j -= e * U[k, j]                        for j > k

Lazy batches: the update is applied inside a block of B columns one column at a time, and to
the columns after the block once per block (W[:, after] -= E_block U[block, after]), which is
the same arithmetic in fewer, larger matmuls. H is dampened first, H += damp * mean(diag H) * I
(damp = DEFAULT_DAMP = 0.1), and an input feature that never fired (H[k, k] = 0) gets H[k, k] = 1 and w_k = 0.

Group scales: when column k starts a group (k % G == 0), the group's scale (and zero point) is
chosen over the group's columns as they are then, i.e. after the error updates from earlier
groups, and rounded to the checkpoint's scale dtype so the codes match what is stored. The
grid is packing.quantize_int4_groupwise's min/max grid with its range shrunk by a clip ratio
r in CLIP_RATIOS (1.0 down to 0.525), chosen per row for the least output error of the group
alone, dw_g H_gg dw_g^T (H_gg: the group's diagonal block of H). Clipping trades the outlier
weights' error for a finer step on the rest; weighting by H keeps the outliers that meet
large inputs (measured on SmolLM2-135M W4A16 g64: the clip search cuts the perplexity
increase of lm_head from +13% to +2.4%; docs/quantization.md). With H = identity and
clip=False no error propagates and GPTQ is exactly round to nearest.

act order (desc_act): quantizing the features in order of decreasing H[k, k] usually helps;
the result is then in permuted feature order and needs the layer's in_perm (`act_order_perm`,
only W4A16_GPTQ layouts hold one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from bestiary.core.format import packing

DEFAULT_DAMP = 0.1  # 0.01 (the paper's) overfits a few thousand calibration tokens: docs/quantization.md
BLOCK = 128  # a multiple of every group size (32, 64, 128): groups never straddle a block


def hessian_error(dw: torch.Tensor, h: torch.Tensor) -> float:
    """trace(dW H dW^T) for dW [N, K], H [K, K]: the summed squared output error over the inputs of H."""
    dw = dw.double()
    return float(((dw @ h.double()) * dw).sum())


def act_order_perm(h: torch.Tensor) -> torch.Tensor:
    """Feature order of decreasing H[k, k] (int64 [K]); quantize W[:, perm] with H[perm][:, perm]."""
    return torch.argsort(torch.diagonal(h), descending=True, stable=True)


def inverse_cholesky(h: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """U [K, K] upper triangular with U^T U = (H + damp * mean(diag H) * I)^-1 (float32).

    A damping that leaves H numerically indefinite is raised tenfold, up to three times."""
    h = h.double()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    mean_diag = float(torch.diagonal(h).mean()) or 1.0
    for attempt in range(4):
        chol, info = torch.linalg.cholesky_ex(h + damp * 10**attempt * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(hinv, upper=True).float()
    raise ValueError("the calibration Hessian is not positive definite even with damping 10x raised 3 times")


CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(20))  # 1.0, 0.975, ..., 0.525


def group_grid(w: torch.Tensor, zero_point: bool, ratio: float,
               scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, g] (one group) -> (s [N], z [N]): packing.int4_grid's grid over the range shrunk by
    `ratio` (1.0: quantize_int4_groupwise's grid), s rounded to scale_dtype; symmetric groups have z = 8."""
    s, z = packing.int4_grid(w, zero_point, ratio)
    if z is None:
        z = torch.full_like(s, 8.0)
    return s.to(scale_dtype).float().clamp(min=1e-12), z


def fake_quantize_group(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """w [N, g] -> (clamp(round(w / s) + z, 0, 15) - z) * s with s, z [N] per row."""
    return ((torch.round(w / s[:, None]) + z[:, None]).clamp(0, 15) - z[:, None]) * s[:, None]


def search_group_grid(w: torch.Tensor, h: torch.Tensor, zero_point: bool, scale_dtype: torch.dtype,
                      ratios: tuple[float, ...] = CLIP_RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, g], H_gg [g, g] -> (s [N], z [N]) of the clip ratio with the least dw H_gg dw^T per row.

    The first ratio is 1.0 (the min/max grid), so no row does worse than round to nearest."""
    best_err, best_s, best_z = _grid_error(w, h, zero_point, ratios[0], scale_dtype)
    for ratio in ratios[1:]:
        err, s, z = _grid_error(w, h, zero_point, ratio, scale_dtype)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def _grid_error(w: torch.Tensor, h: torch.Tensor, zero_point: bool, ratio: float,
                scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, g], H_gg [g, g] -> (dw H_gg dw^T [N], s [N], z [N]) of the grid clipped by `ratio`."""
    s, z = group_grid(w, zero_point, ratio, scale_dtype)
    dw = fake_quantize_group(w, s, z) - w  # [N, g]
    return ((dw @ h) * dw).sum(dim=1), s, z


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the column loop's many small ops on one thread (no barrier waits between them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gptq_int4(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    zero_point: bool,
    damp: float = DEFAULT_DAMP,
    scale_dtype: torch.dtype = torch.float32,
    clip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K], H [K, K] -> (codes uint8 [N, K], s float32 [N, groups], z float32 [N, groups] or None),
    the layout of packing.quantize_int4_groupwise (math in the module docstring). `clip`: search
    each group's clip ratio (else the plain min/max grid). `w` is not modified."""
    n, k = w.shape
    if tuple(h.shape) != (k, k):
        raise ValueError(f"Hessian {tuple(h.shape)} does not match the weight's {k} input features")
    h = h.double().clone()
    h_block = h.float()  # undamped, for the clip search
    # [K, N]: column k of W is row k here (contiguous); always a copy (w may be W^T's view)
    wt = torch.empty(k, n, dtype=torch.float32).copy_(w.t())
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    wt[dead] = 0.0
    u = inverse_cholesky(h, damp)  # [K, K] upper
    groups = packing.num_groups(k, group_size)
    codes = torch.empty(k, n, dtype=torch.uint8)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    lo, hi = (0.0, 15.0) if zero_point else (-8.0, 7.0)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        wb = wt[b0:b1]  # [B, N] view: the block's columns, updated column by column
        qb = torch.empty_like(wb)  # rounded values: codes - (0 if zero_point else 8)
        errs = torch.empty_like(wb)  # [B, N]
        ub = u[b0:b1, b0:b1]
        with _one_thread():
            for i in range(b1 - b0):
                col = b0 + i
                if col % group_size == 0:
                    g = col // group_size
                    wg, hg = wb[i:i + group_size].t(), h_block[col:col + group_size, col:col + group_size]
                    s, z = (search_group_grid(wg, hg, zero_point, scale_dtype) if clip
                            else group_grid(wg, zero_point, 1.0, scale_dtype))  # [N]
                    scales[:, g], zeros[:, g] = s, z
                    offset = z if zero_point else torch.zeros_like(z)
                    neg_offset_scale = -offset * s
                # q = clamp(round(w / s) + o, lo, hi), w_hat = (q - o) s, o = z (zero point) or 0
                q = torch.div(wb[i], s, out=qb[i]).round_().add_(offset).clamp_(lo, hi)
                err = torch.sub(wb[i], torch.addcmul(neg_offset_scale, q, s), out=errs[i]).div_(ub[i, i])
                wb[i + 1:].addr_(ub[i, i + 1:], err, alpha=-1.0)
        codes[b0:b1] = (qb if zero_point else qb + 8).to(torch.uint8)
        wt[b1:].addmm_(u[b0:b1, b1:].t(), errs, alpha=-1.0)
    return codes.t().contiguous(), scales, (zeros if zero_point else None)
