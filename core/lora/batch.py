"""One step's adapters: stacked per linear (`AdapterStack`) and applied per token (`StepLora`).

A *site* is the output of one or more linears that read the same input, side by side (a
plain linear, or a gated MLP's fused [fc; gate]). For the adapters 0..L-1 of a step, the site's
pieces are concatenated along the rank (no padding, each adapter its own ranks):

    A_cat [R, K]   the A of every piece of every adapter, stacked
    B_cat [N, R]   each piece's B in its linear's rows of the site, zeros elsewhere
    owner [R]      the adapter (0..L-1) a rank column belongs to;  scale [R] its piece's scaling

and a token t of adapter a_t (-1: none) gets

    delta[t] = ((x[t] A_cat^T) * mask[t]) B_cat^T,    mask[t, j] = scale[j] if owner[j] == a_t else 0

two dense matmuls for the whole packed batch, whatever the mix of adapters and ranks: no
Python loop over requests. On the CPU a half-precision model's sites are held and computed in
float32 (these skinny matmuls run ~3x faster than in bf16 here) and the delta rounded once. On CUDA a site goes through the SGMV/BGMV kernels instead
(core.kernels.lora: the same pieces padded to the largest rank, B pre-scaled). The compiled CPU
decode plan reads a site's `rows` (core.kernels.cpu.ops.LoraRows, in the model's dtype): each row only
its own adapter's A and B, and only the columns a piece's B reaches,

    delta[t] = sum over pieces p of a_t:  ((x[t] A_p^T) * s_p) B_p^T   (in B_p's columns)

the same sums as the mask form, without the other adapters' ranks or the zero blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.cpu import ops as cpu_ops
from bestiary.core.layers.linear import Parallel
from bestiary.core.lora.adapter import LoraAdapter

SiteKey = tuple[tuple[str, int, int], ...]  # (linear path, expert or -1, rows) per part, in output order


@dataclass
class Site:
    """One site's adapters, concatenated (shapes in the module docstring); `sgmv` on CUDA."""

    a_t: torch.Tensor  # [K, R] (A_cat^T, contiguous)
    b_t: torch.Tensor  # [R, N] (B_cat^T, contiguous)
    owner: torch.Tensor  # [R] int64
    scale: torch.Tensor  # [R] float32
    sgmv: dispatch.LoraWeights | None = None
    rows: cpu_ops.LoraRows | None = None  # the compiled decode plan's per-row layout (CPU)


class AdapterStack:
    """The adapters of a step (slot s = adapters[s]), stacked per site on first use."""

    def __init__(self, adapters: Sequence[LoraAdapter], dtype: torch.dtype, device: torch.device | str) -> None:
        self.adapters = tuple(adapters)
        self.dtype, self.device = dtype, torch.device(device)
        self._sites: dict[SiteKey, Site | None] = {}
        self._layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # shared owner / scale tensors
        self._keys: dict[tuple[int, ...], SiteKey] = {}

    def site(self, key: SiteKey) -> Site | None:
        """The stacked site `key`, or None when no adapter touches it."""
        if key not in self._sites:
            self._sites[key] = self._build(key)
        return self._sites[key]

    def site_of(self, modules: Sequence, expert: int = -1) -> Site | None:
        """The site of `modules`' outputs side by side (their expert `expert` for stacked experts)."""
        ids = (*map(id, modules), expert)  # the model outlives the stack: ids stay valid
        key = self._keys.get(ids)
        if key is None:
            key = self._keys[ids] = _key(modules, expert)
        return self.site(key)

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for half-precision models on the CPU (see the module docstring), else the model's dtype."""
        half = self.dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if half and self.device.type == "cpu" else self.dtype

    def _build(self, key: SiteKey) -> Site | None:
        """Concatenate every adapter's pieces on the site's linears (None: no adapter touches them)."""
        n_total = sum(rows for *_, rows in key)
        a_parts, b_parts, owner, scale = [], [], [], []
        per_adapter: list[tuple[list[torch.Tensor], list[torch.Tensor], list[float]]] = []
        for slot, adapter in enumerate(self.adapters):
            a_s, b_s, sc_s = [], [], []
            offset = 0
            for path, expert, rows in key:
                for piece in adapter.pieces.get((path, expert), ()):
                    b = torch.zeros(n_total, piece.rank, dtype=self.dtype)
                    b[offset : offset + rows] = piece.b
                    a_s.append(piece.a)
                    b_s.append(b)
                    sc_s += [piece.scaling] * piece.rank
                offset += rows
            per_adapter.append((a_s, b_s, sc_s))
            a_parts += a_s
            b_parts += b_s
            owner += [slot] * len(sc_s)
            scale += sc_s
        if not a_parts:
            return None
        layout = (tuple(owner), tuple(scale))
        if layout not in self._layouts:
            self._layouts[layout] = (torch.tensor(owner, device=self.device),
                                     torch.tensor(scale, dtype=torch.float32, device=self.device))
        owner_t, scale_t = self._layouts[layout]
        a_cat = torch.cat(a_parts).to(self.dtype)  # [R, K]
        b_cat = torch.cat(b_parts, dim=1)  # [N, R]
        cd = self.compute_dtype
        site = Site(a_cat.t().contiguous().to(self.device, cd), b_cat.t().contiguous().to(self.device, cd), owner_t,
                    scale_t)
        if self.device.type == "cuda" or dispatch.mode() == "triton":  # (triton on the CPU: the kernel tests)
            site.sgmv = _padded(per_adapter, a_cat.shape[1], n_total, self.dtype, self.device)
        if self.device.type == "cpu" and all(expert == -1 for _, expert, _ in key):  # (a plan has no experts)
            site.rows = _row_layout(per_adapter, a_cat.shape[1], n_total, self.dtype)
        return site


def _row_layout(per_adapter, k: int, n: int, dtype: torch.dtype) -> cpu_ops.LoraRows:
    """The compiled plan's layout: each adapter's pieces (a [r, K], b [N, r], scale [r]) in the
    model's dtype (float32 for any other)."""
    pieces = []
    for a_s, b_s, sc_s in per_adapter:
        scales = torch.tensor(sc_s, dtype=torch.float32).split([a.shape[0] for a in a_s])
        pieces.append(list(zip(a_s, b_s, scales)))
    held = dtype if dtype in cpu_ops.DTYPES else torch.float32
    return cpu_ops.LoraRows.build(pieces, k, n, held)


def _padded(per_adapter, k: int, n: int, dtype: torch.dtype, device) -> dispatch.LoraWeights:
    """SGMV's layout: lora_a [L, R_max, K], lora_b [L, N, R_max] with B pre-scaled, scalings 1."""
    ranks = [sum(a.shape[0] for a in a_s) for a_s, _, _ in per_adapter]
    r_max = max(max(ranks), 1)
    lora_a = torch.zeros(len(per_adapter), r_max, k, dtype=dtype)
    lora_b = torch.zeros(len(per_adapter), n, r_max, dtype=dtype)
    for i, (a_s, b_s, sc_s) in enumerate(per_adapter):
        if a_s:
            lora_a[i, : ranks[i]] = torch.cat(a_s)
            lora_b[i, :, : ranks[i]] = torch.cat(b_s, dim=1) * torch.tensor(sc_s, dtype=dtype)
    return dispatch.LoraWeights(lora_a.to(device), lora_b.to(device), torch.tensor(ranks, dtype=torch.int32, device=device),
                                torch.ones(len(per_adapter), device=device))


class StepLora:
    """The `LoraDelta` of one step: sequence i (seq_lens[i] packed tokens) uses stack slot slots[i] (-1: none)."""

    def __init__(self, stack: AdapterStack, seq_lens: list[int], slots: list[int]) -> None:
        if len(seq_lens) != len(slots):
            raise ValueError(f"LoRA step: {len(seq_lens)} sequences but {len(slots)} adapter slots")
        self.stack = stack
        device = stack.device
        self.token_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(seq_lens)).to(device)  # [T]
        self.seq_lens, self.slots = seq_lens, slots
        self._masks: dict[int, torch.Tensor] = {}  # id(site.owner) -> [T, R]
        self._segments: tuple[torch.Tensor, torch.Tensor, int] | None = None

    # --- the LoraDelta protocol (core.layers.linear) -------------------------------------
    def __call__(self, module, x: torch.Tensor) -> torch.Tensor | None:
        """delta [T, out] of one linear on x [T, in], or None when no adapter touches it."""
        return self.concat((module,), x)

    def concat(self, modules: Sequence, x: torch.Tensor) -> torch.Tensor | None:
        """delta [T, sum out] of linears reading the same x, their outputs side by side."""
        site = self.stack.site_of(modules)
        if site is None:
            return None
        if site.sgmv is not None and dispatch.use_triton(x):
            starts, adapters, longest = self._sgmv_segments()
            w = site.sgmv
            return dispatch.lora_sgmv(x, w.lora_a, w.lora_b, starts, adapters, w.ranks, w.scalings, longest)
        v = torch.mm(x.to(site.a_t.dtype), site.a_t).mul_(self._mask(site))  # [T, R]
        return torch.mm(v, site.b_t).to(x.dtype)  # [T, N]

    def add_(self, modules: Sequence, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, sum out] += the site's delta on x [T, in] (the compiled CPU plan's buffers)."""
        site = self.stack.site_of(modules)
        if site is not None:
            v = torch.mm(x.to(site.a_t.dtype), site.a_t).mul_(self._mask(site))
            out.add_(torch.mm(v, site.b_t))

    def expert(self, modules: Sequence, expert: int, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """delta [N, sum out] of expert `expert` of stacked expert linears on x [N, in], the packed
        batch's rows `tokens` [N]."""
        site = self.stack.site_of(modules, expert)
        if site is None:
            return None
        v = torch.mm(x.to(site.a_t.dtype), site.a_t).mul_(self._mask(site).index_select(0, tokens))
        return torch.mm(v, site.b_t).to(x.dtype)

    # --- per step ------------------------------------------------------------------------
    def _mask(self, site: Site) -> torch.Tensor:
        """[T, R]: scale[j] where column j belongs to the token's adapter, else 0 (one per layout and step)."""
        mask = self._masks.get(id(site.owner))
        if mask is None:
            hit = self.token_slot[:, None] == site.owner[None, :]
            mask = self._masks[id(site.owner)] = torch.where(hit, site.scale, 0.0).to(site.a_t.dtype)
        return mask

    def _sgmv_segments(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self._segments is None:
            starts = [0]
            for n in self.seq_lens:
                starts.append(starts[-1] + n)
            device = self.stack.device
            self._segments = (torch.tensor(starts, dtype=torch.int32, device=device),
                              torch.tensor(self.slots, dtype=torch.int32, device=device), max(self.seq_lens))
        return self._segments


def _key(modules: Sequence, expert: int = -1) -> SiteKey:
    """Site key of linears side by side: (path, expert, local rows) each."""
    return tuple((m.name, expert, _rows(m)) for m in modules)


def _rows(module) -> int:
    """Local output rows of a Linear / ExpertLinear (whatever its packed weight layout)."""
    tp = module.tp_size if module.parallel == Parallel.COLUMN else 1
    return module.out_features // tp
