"""Launcher-argument contracts of core/kernels that `make mutation` (tests/mutation_run.py kernels)
left unsorted: the attention launchers' per-sequence and per-window tensors, lora_sgmv's grid and
rank block at the edges (one segment, none, a rank wider than the input), align_slots' layout.

Here, not in tests/, because the kernel modules must be imported under this folder's conftest
(TRITON_INTERPRET=1). Each test names the mutants it kills; the references are written out in the
test with torch, not taken from the module's own `_ref` functions.
"""

from __future__ import annotations

import torch
from kernel_helpers import assert_close, assert_far, paged_inputs, sequence_kv

from bestiary.core.kernels import dispatch


def _dense(q, meta, k_pool, v_pool, scale, windows=None, sinks=None, prefix=None):
    """softmax_j(scale * q_i . k_j) v_j over the keys with (j <= i or j < prefix) and (no window or
    j < sink or i - j < window - sink), written out per sequence from the pools' slots:
    q [T, H, D] -> [T, H * D] float32 (windows / sinks / prefix: per sequence, None = none)."""
    h, outs, start = q.shape[1], [], 0
    nseq = len(meta.seq_lens)
    windows, sinks, prefix = windows or [0] * nseq, sinks or [0] * nseq, prefix or [0] * nseq
    for b, (n, ctx) in enumerate(zip(meta.seq_lens, meta.context_lens)):
        pos, kk, vv = sequence_kv(meta, k_pool, v_pool, b, ctx + n, h)  # [L], [L, H, D] x 2
        qpos = (ctx + torch.arange(n))[:, None]  # [n, 1]
        w, s = windows[b], sinks[b]
        seen = ((pos[None] <= qpos) | (pos[None] < prefix[b])) & ((w == 0) | (pos[None] < s) | (qpos - pos[None] < w - s))
        scores = torch.einsum("nhd,lhd->hnl", q[start : start + n].cpu().float(), kk) * scale
        probs = scores.masked_fill(~seen[None], float("-inf")).softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vv).reshape(n, -1))
        start += n
    return torch.cat(outs)


def test_sequence_args_are_the_per_sequence_rows(device) -> None:
    """_sequence_args(meta, device): int32 rows q_start = the packed offset of each sequence's first
    query (0, n0, n0 + n1, ...), seq_len, ctx_len, kv_len = ctx + n, prefix = prefix_lens under a
    prefix-LM mask and 0 under a causal one (even when prefix_lens is set), and the block table.
    Kills _sequence_args 4 (the first sequence at 1) and 8 (offsets subtracted), which the kernel
    tests only caught by an out-of-bounds write that aborted the process, 14 (prefix_lens used
    under a causal mask), 19 (a causal prefix of 1: no visible change, key 0 is always seen) and
    39, 41 (int64 rows)."""
    attention = dispatch.family("attention")
    seq, ctx = [3, 1, 4], [2, 0, 5]
    for mask, prefix_lens, want_prefix in (("causal", None, [0, 0, 0]), ("causal", [2, 1, 3], [0, 0, 0]),
                                            ("prefix_lm", [2, 1, 3], [2, 1, 3])):
        _, _, _, meta, _, _ = paged_inputs(seq, ctx, 2, 1, 16, torch.float32, device, mask=mask,
                                           prefix_lens=prefix_lens)
        args = attention._sequence_args(meta, device)
        want = dict(q_start=[0, 3, 4], seq_len=seq, ctx_len=ctx, prefix=want_prefix, kv_len=[5, 1, 9])
        for name, row in want.items():
            assert args[name].dtype == torch.int32, name
            assert args[name].device.type == device.type, name
            assert args[name].cpu().tolist() == row, (mask, prefix_lens, name)
        assert torch.equal(args["table"].cpu(), meta.block_tables.cpu())
        assert attention._sequence_args(meta, device) is args  # built once per step


def test_causal_prefill_ignores_prefix_lens(device) -> None:
    """A causal step whose metadata carries prefix_lens attends causally (the prefix is read only
    under mask="prefix_lm", as the torch path does); the same step under prefix_lm differs, so the
    check can fail. Kills _sequence_args 14 (`mask == "prefix_lm" or prefix_lens`)."""
    attention = dispatch.family("attention")
    torch.manual_seed(7)
    seq, ctx, prefix = [6, 5], [0, 3], [5, 7]
    for mask in ("causal", "prefix_lm"):
        torch.manual_seed(7)
        q, k, v, meta, kp, vp = paged_inputs(seq, ctx, 2, 1, 16, torch.float32, device, mask=mask, prefix_lens=prefix)
        want = _dense(q, meta, kp, vp, 0.25, prefix=prefix if mask == "prefix_lm" else None)
        out = attention.paged_attention(q, k, v, meta, kp, vp, 0.25, None)
        assert_close(out.cpu(), want, torch.float32)
        if mask == "causal":
            assert_far(_dense(q, meta, kp, vp, 0.25, prefix=prefix), want, torch.float32)


def test_window_args_are_cached_per_layer_window(device) -> None:
    """Two layers with different windows (the same sinks) in one step share the metadata: each
    launch uses its own bounds, not the first layer's from the per-step cache (as in models that
    alternate local and global layers). Kills _window_args 2 and 10 (every window under the key
    None) and 6 (a key of the sinks twice: equal sinks, different windows collide)."""
    attention = dispatch.family("attention")
    torch.manual_seed(8)
    seq, ctx = [6, 4], [0, 9]
    q, k, v, meta, kp, vp = paged_inputs(seq, ctx, 2, 1, 16, torch.float32, device)
    layers = (([3, 4], [1, 1]), ([5, 8], [1, 1]), ([3, 4], [1, 1]))  # the third: the first layer's again
    wants = [_dense(q, meta, kp, vp, 0.3, list(w), list(s)) for w, s in layers]
    assert_far(wants[0], wants[1], torch.float32)
    for (w, s), want in zip(layers, wants):
        out = attention.paged_attention(q, k, v, meta, kp, vp, 0.3, None, bounds=(list(w), list(s)))
        assert_close(out.cpu(), want, torch.float32)


def _lora_delta(x, lora_a, lora_b, seg_starts, seg_adapters, ranks, scalings):
    """delta[t] = scaling_a * B_a[:, :r_a] (A_a[:r_a] x[t]) for the rows of segments with an adapter
    a >= 0, zero elsewhere, in float64: x [T, K] -> [T, N] float32."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64)
    starts = [int(u) for u in seg_starts]
    for s, a in enumerate(int(u) for u in seg_adapters):
        if a >= 0:
            r = int(ranks[a])
            rows = x[starts[s] : starts[s + 1]].cpu().double()
            a_mat, b_mat = lora_a[a, :r].cpu().double(), lora_b[a, :, :r].cpu().double()
            out[starts[s] : starts[s + 1]] = rows @ a_mat.t() @ b_mat.t() * float(scalings[a])
    return out.float()


def test_lora_sgmv_one_segment_and_none(device) -> None:
    """lora_sgmv on a batch of one segment (one sequence: the common single-request step) gives its
    delta; with no segment, or only empty ones, zeros of [T, N], whether max_seg_len is read from
    seg_starts or passed. Kills lora_sgmv 54 (one segment returned zeros) and 20 (the max over no
    segment lengths raised)."""
    lora = dispatch.family("lora")
    torch.manual_seed(9)
    i32 = dict(dtype=torch.int32, device=device)
    x = torch.randn(5, 24, device=device)
    la, lb = torch.randn(2, 8, 24, device=device), torch.randn(2, 20, 8, device=device)
    ranks, scalings = torch.tensor([8, 5], **i32), torch.tensor([0.5, 2.0], device=device)
    starts, adapters = torch.tensor([0, 5], **i32), torch.tensor([1], **i32)
    want = _lora_delta(x, la, lb, starts, adapters, ranks, scalings)
    assert want.abs().max() > 1.0
    for max_seg_len in (None, 5):
        out = lora.lora_sgmv(x, la, lb, starts, adapters, ranks, scalings, block_n=32, block_k=32,
                             max_seg_len=max_seg_len)
        assert_close(out.cpu(), want, torch.float32)
    cases = ((torch.tensor([0], **i32), torch.tensor([], **i32), None),  # no segment
             (torch.tensor([0], **i32), torch.tensor([], **i32), 4),
             (torch.tensor([0, 0, 0], **i32), torch.tensor([0, 1], **i32), None),  # two empty ones
             (torch.tensor([0, 0, 0], **i32), torch.tensor([0, 1], **i32), 4))
    for seg_starts, seg_adapters, max_seg_len in cases:
        out = lora.lora_sgmv(x, la, lb, seg_starts, seg_adapters, ranks, scalings, max_seg_len=max_seg_len)
        assert out.shape == (5, 20) and out.dtype == x.dtype
        assert torch.equal(out.cpu(), torch.zeros(5, 20))


def test_lora_sgmv_rank_wider_than_the_input(device) -> None:
    """Adapters whose rank (24, 32) exceeds the input width K = 16: every rank column counts (the
    rank block covers lora_a's rank dim, not its input dim). Kills lora_sgmv 15 (the block sized
    from K: 16 of the ranks only)."""
    lora = dispatch.family("lora")
    torch.manual_seed(10)
    i32 = dict(dtype=torch.int32, device=device)
    x = torch.randn(6, 16, device=device)
    la, lb = torch.randn(2, 32, 16, device=device) / 4, torch.randn(2, 12, 32, device=device) / 4
    args = (torch.tensor([0, 2, 6], **i32), torch.tensor([0, 1], **i32), torch.tensor([24, 32], **i32),
            torch.tensor([1.5, 0.5], device=device))
    want = _lora_delta(x, la, lb, *args)
    out = lora.lora_sgmv(x, la, lb, *args, block_n=16, block_k=16)
    assert_close(out.cpu(), want, torch.float32)


def test_align_slots_layout(device) -> None:
    """align_slots(experts [T, K], E, block_m): each expert's slots in ascending order (stable: the
    tokens of a block are read in order), its run padded with n = T*K to a multiple of block_m, the
    runs one after another in expert order, the rest filled with n; block_expert names each block's
    expert and -1 for every block past the last run, also when the highest experts get no slot.
    64 slots with repeated ids: where torch's CPU argsort stops being stable. Kills align_slots 11,
    12 (an unstable sort) and 17 (bincount without minlength: the blocks past the runs named by
    expert max+1 instead of -1)."""
    moe = dispatch.family("moe")
    torch.manual_seed(11)
    num_experts, block_m = 6, 8
    experts = torch.randint(0, 4, (32, 2), device=device)  # experts 4, 5 unused
    experts[0, 0], experts[5, 1] = 2, 0  # 0 and 2 certainly used
    flat = experts.reshape(-1).cpu()
    n = flat.numel()
    num_blocks = -(-n // block_m) + num_experts
    want_slots, want_blocks = [], []
    for e in range(num_experts):
        run = [i for i in range(n) if int(flat[i]) == e]
        padded = -(-len(run) // block_m) * block_m
        want_slots += run + [n] * (padded - len(run))
        want_blocks += [e] * (padded // block_m)
    want_slots += [n] * (num_blocks * block_m - len(want_slots))
    want_blocks += [-1] * (num_blocks - len(want_blocks))
    sorted_slots, block_expert = moe.align_slots(experts, num_experts, block_m)
    assert sorted_slots.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert sorted_slots.cpu().tolist() == want_slots
    assert block_expert.cpu().tolist() == want_blocks
