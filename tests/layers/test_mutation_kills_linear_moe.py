"""core/layers linear, embedding and MoE contracts that `make mutation` (tests/mutation_run.py
layers_linear_moe) found untested: the expert linears' placement under tensor and expert parallelism, the
router's and the top-k bound's refusals, LoRA through the shared expert, stacking per-expert sources,
and the tensor-parallel linears and embeddings computed rank by rank on one process (the collectives
replaced by what they compute) against the whole layer.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_ep import rank_moe

from bestiary.core.layers import embedding as embedding_module
from bestiary.core.layers import linear as linear_module
from bestiary.core.layers import moe as moe_module
from bestiary.core.layers.embedding import Embedding
from bestiary.core.layers.linear import Linear, Parallel, tp_dim_of
from bestiary.core.layers.moe import ExpertLinear, MoE, SharedExpertMoE, route, stack_experts


def test_expert_linear_placement():
    whole = ExpertLinear(4, 6, 8, Parallel.COLUMN)
    assert (whole.tp_rank, whole.tp_size, whole.ep_rank, whole.ep_size) == (0, 1, 0, 1)
    assert whole.weight.shape == (4, 8, 6) and not whole.weight.requires_grad and whole.name == ""
    assert whole.tp_dim("weight") == 1 and whole.shard("weight") == {}
    col = ExpertLinear(4, 6, 8, Parallel.COLUMN, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2,
                       dtype=torch.bfloat16, device="meta")
    assert col.weight.shape == (2, 4, 6) and col.weight.dtype == torch.bfloat16 and col.weight.device.type == "meta"
    assert (col.num_local, col.first_expert) == (2, 2)
    assert col.shard("weight") == {"tp_split": (2, 1), "experts": (2, 1)}
    row = ExpertLinear(4, 8, 6, Parallel.ROW, tp_rank=0, tp_size=2)
    assert row.weight.shape == (4, 6, 4) and row.tp_dim("weight") == 2
    rep = ExpertLinear(4, 6, 5, Parallel.REPLICATED, tp_size=2)  # 5 rows are not split: no refusal
    assert rep.weight.shape == (4, 5, 6) and rep.tp_dim("weight") == -1
    with pytest.raises(ValueError, match="num_local_experts 5 is not divisible by moe_ep_size 2"):
        ExpertLinear(5, 6, 8, Parallel.COLUMN, ep_size=2)
    with pytest.raises(ValueError, match="expert intermediate_size 7 is not divisible by tp_size 2"):
        ExpertLinear(4, 6, 7, Parallel.COLUMN, tp_size=2)
    with pytest.raises(ValueError, match="expert intermediate_size 7 is not divisible by tp_size 2"):
        ExpertLinear(4, 7, 6, Parallel.ROW, tp_size=2)
    ExpertLinear(4, 7, 6, Parallel.COLUMN, tp_size=2)  # a column split does not cut in_features


def test_route_against_the_formula():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 4.0]], dtype=torch.bfloat16)
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[1, 2], [3, 0]] and weights.dtype == torch.float32
    top = logits.float().gather(1, experts)
    torch.testing.assert_close(weights, top.softmax(-1))
    weights, experts = route(logits, 2, renormalize=False)
    assert experts.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, logits.float().softmax(-1).gather(1, experts))


def test_moe_placement_and_refusals():
    moe = MoE(6, 8, 4, 4)  # top_k = num_experts is allowed
    assert moe.act_name == "silu" and moe.top_k == 4
    assert moe.router.parallel == Parallel.REPLICATED and moe.router.weight.shape == (4, 6)
    assert (moe.fc.tp_rank, moe.fc.tp_size, moe.fc.ep_size) == (0, 1, 1)
    MoE(6, 8, 4, 1)
    for top_k in (0, 5):
        with pytest.raises(ValueError, match=f"num_experts_per_tok {top_k} must be in 1..num_local_experts \\(4\\)"):
            MoE(6, 8, 4, top_k)
    with pytest.raises(ValueError, match="moe_ep_size 3 does not divide tp_size 4"):
        MoE(6, 8, 6, 2, tp_size=4, ep_size=3)
    ranked = MoE(6, 8, 4, 2, tp_rank=3, tp_size=4, ep_size=2, dtype=torch.bfloat16, device="meta")
    for lin in (ranked.fc, ranked.gate, ranked.proj):  # moe_tp rank 3 // 2, size 4 / 2; ep rank 3 % 2
        assert (lin.tp_rank, lin.tp_size, lin.ep_rank, lin.ep_size) == (1, 2, 1, 2)
        assert lin.weight.dtype == torch.bfloat16 and lin.weight.device.type == "meta"
    assert ranked.router.weight.dtype == torch.bfloat16 and ranked.router.weight.device.type == "meta"
    assert ranked.router.parallel == Parallel.REPLICATED
    assert ranked.fc.weight.shape == (2, 4, 6) and ranked.proj.weight.shape == (2, 6, 4)


class Spy:
    """A LoRA delta that records which modules asked and adds nothing."""

    def __init__(self):
        self.asked = []

    def __call__(self, module, x):
        self.asked.append(module)

    def concat(self, modules, x):
        self.asked.extend(modules)

    def expert(self, modules, e, x, tokens):
        self.asked.extend(modules)


def test_shared_expert_moe_placement_and_lora():
    moe = SharedExpertMoE(6, 8, 4, 2, 10)
    assert moe.act_name == "silu" and moe.renormalize and moe.ep_size == 1
    assert moe.shared_expert.fc.bias is None and moe.shared_expert_gate.parallel == Parallel.REPLICATED
    assert moe.router.keep_float and moe.shared_expert_gate.keep_float
    ranked = SharedExpertMoE(6, 8, 4, 2, 10, tp_rank=1, tp_size=2, dtype=torch.bfloat16, device="meta", ep_size=2,
                             renormalize=False)
    assert not ranked.renormalize and (ranked.fc.ep_rank, ranked.fc.ep_size) == (1, 2)
    assert (ranked.shared_expert.fc.tp_rank, ranked.shared_expert.fc.tp_size) == (1, 2)
    for p in (ranked.router.weight, ranked.shared_expert.fc.weight, ranked.shared_expert_gate.weight):
        assert p.dtype == torch.bfloat16 and p.device.type == "meta"
    assert ranked.shared_expert_gate.weight.shape == (1, 6)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    spy = Spy()
    x = torch.randn(3, 6)
    out = moe(x, spy)
    torch.testing.assert_close(out, moe(x))  # a delta of None changes nothing
    assert moe.router in spy.asked  # the router and the shared expert's linears are asked for deltas
    assert any(m in spy.asked for m in (moe.shared_expert.fc, moe.shared_expert.proj))


def test_stack_experts():
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(stack_experts("k", [a, b], None)["k"], torch.stack([a, b]))
    stacked = torch.randn(2, 3, 2)
    assert stack_experts("k", [stacked], None)["k"] is stacked
    with pytest.raises(ValueError, match=r"k: expected per-expert 2-D matrices, got shapes \[\(2, 3, 2\), \(3, 2\)\]"):
        stack_experts("k", [stacked, a], None)
    with pytest.raises(ValueError, match=r"got shapes \[\(3,\)\]"):
        stack_experts("k", [torch.randn(3)], None)


class FakeCollectives:
    """torch.distributed's all_reduce / all_gather for ranks run one after another in one process: a first
    pass records what each rank hands over, a second gives each rank the reduced / gathered result."""

    def __init__(self, monkeypatch, *modules):
        self.sent: list[torch.Tensor] = []
        self.groups: set = set()  # the process groups asked for (a layer's tp_group under pipeline parallelism)
        self.total: torch.Tensor | None = None
        for module in modules:
            monkeypatch.setattr(module.torch.distributed, "all_reduce", self.all_reduce)
            monkeypatch.setattr(module.torch.distributed, "all_gather", self.all_gather)

    def all_reduce(self, t, group=None):
        self.groups.add(group)
        if self.total is None:
            self.sent.append(t.clone())
        else:
            t.copy_(self.total)

    def all_gather(self, parts, t, group=None):
        self.groups.add(group)
        if self.total is None:
            self.sent.append(t.clone())
            for p in parts:
                p.copy_(t)
        else:
            for p, s in zip(parts, self.sent):
                p.copy_(s)

    def reduce(self) -> None:
        """Between the passes: the sum of what the ranks handed over (all_gather keeps the list)."""
        self.total = torch.stack(self.sent).sum(0)


def ranks_of(layer_of, load, tp: int = 2):
    """tp layers built by layer_of(rank), each loaded by load(layer, rank)."""
    layers = [layer_of(r) for r in range(tp)]
    for r, layer in enumerate(layers):
        load(layer, r)
    return layers


@pytest.mark.parametrize("bias", [False, True])
def test_row_and_column_parallel_linears_equal_the_whole(monkeypatch, bias):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(6, 8, generator=g), torch.randn(6, generator=g), torch.randn(3, 8, generator=g)
    whole = torch.nn.functional.linear(x, w, b if bias else None)
    fake = FakeCollectives(monkeypatch, linear_module)

    def load(layer, r):  # Megatron's cut, written here: a row-parallel W by in-features, its bias whole
        dim = 1 if layer.parallel == Parallel.ROW else 0
        size = w.shape[dim] // 2
        layer.weight.data.copy_(w.narrow(dim, r * size, size))
        if bias:
            layer.bias.data.copy_(b if dim == 1 else b.narrow(0, r * 3, 3))

    row = ranks_of(lambda r: Linear(8, 6, bias, Parallel.ROW, tp_rank=r, tp_size=2), load)
    for lin in row:
        lin.tp_group = "stage tp group"
    assert [lin.weight.shape for lin in row] == [(6, 4)] * 2
    assert (row[0].tp_dim("weight"), row[0].tp_dim("bias")) == (1, -1)
    for r, lin in enumerate(row):  # first pass: the partial products, before any bias
        lin(x[:, 4 * r : 4 * r + 4])
    torch.testing.assert_close(sum(fake.sent), x @ w.T)
    fake.reduce()
    for r, lin in enumerate(row):
        torch.testing.assert_close(lin(x[:, 4 * r : 4 * r + 4]), whole)
    assert fake.groups == {"stage tp group"}
    col = ranks_of(lambda r: Linear(8, 6, bias, Parallel.COLUMN, tp_rank=r, tp_size=2), load)
    assert col[1].tp_dim("weight") == 0 and col[1].tp_dim("bias") == 0
    torch.testing.assert_close(torch.cat([lin(x) for lin in col], -1), whole)


def test_linear_shapes_refusals_and_repr():
    assert tp_dim_of(Parallel.COLUMN, True) == 0 and tp_dim_of(Parallel.COLUMN, False) == 0
    assert tp_dim_of(Parallel.ROW, True) == 1 and tp_dim_of(Parallel.ROW, False) == -1
    assert tp_dim_of(Parallel.REPLICATED, True) == -1
    lin = Linear(8, 6)
    assert (lin.parallel, lin.tp_rank, lin.tp_size, lin.bias, lin.name, lin.quant) == (
        Parallel.REPLICATED, 0, 1, None, "", None)
    assert lin.weight.shape == (6, 8) and lin.weight.dtype == torch.float32 and not lin.weight.requires_grad
    half = Linear(8, 6, True, "column", tp_rank=1, tp_size=2, dtype=torch.bfloat16, device="meta")
    assert half.parallel == Parallel.COLUMN and half.weight.shape == (3, 8) and half.bias.shape == (3,)
    assert half.weight.dtype == half.bias.dtype == torch.bfloat16 and half.bias.device.type == "meta"
    assert not half.bias.requires_grad
    with pytest.raises(ValueError, match="^out_features 7 is not divisible by tp_size 2$"):
        Linear(8, 7, parallel=Parallel.COLUMN, tp_size=2)
    with pytest.raises(ValueError, match="^in_features 7 is not divisible by tp_size 2$"):
        Linear(7, 8, parallel=Parallel.ROW, tp_size=2)
    Linear(7, 7, parallel=Parallel.REPLICATED, tp_size=2)  # nothing is split
    assert repr(half) == "Linear(in=8, out=6, bias=True, parallel=column, tp=1/2)"
    assert repr(ExpertLinear(4, 6, 8, Parallel.ROW, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)) == (
        "ExpertLinear(experts=4, in=6, out=8, parallel=row, tp=1/2, ep=1/2 (experts 2..3))")
    assert repr(ExpertLinear(4, 6, 8, Parallel.COLUMN)) == "ExpertLinear(experts=4, in=6, out=8, parallel=column, tp=0/1)"


@pytest.mark.parametrize("sharding_dim", [0, 1])
def test_parallel_embeddings_equal_the_whole(monkeypatch, sharding_dim):
    w = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 4, 5, 9, 3, 5])
    fake = FakeCollectives(monkeypatch, embedding_module)

    def load(emb, r):
        size = w.shape[sharding_dim] // 2
        emb.weight.data.copy_(w.narrow(sharding_dim, r * size, size))

    ranks = ranks_of(lambda r: Embedding(10, 6, tp_rank=r, tp_size=2, sharding_dim=sharding_dim), load)
    for emb in ranks:
        emb.tp_group = "stage tp group"
    assert [e.tp_dim("weight") for e in ranks] == [sharding_dim] * 2
    assert ranks[1].vocab_start == (5 if sharding_dim == 0 else 0)
    for emb in ranks:
        emb(ids)
    if sharding_dim == 0:  # each rank hands over its own rows, zeros elsewhere
        for r, sent in enumerate(fake.sent):
            mine = (ids >= 5 * r) & (ids < 5 * r + 5)
            torch.testing.assert_close(sent, w[ids] * mine[:, None])
        fake.reduce()
    else:
        fake.total = w[ids]  # all_gather: the second pass hands every rank the recorded parts
    for emb in ranks:
        torch.testing.assert_close(emb(ids), w[ids])
    assert fake.groups == {"stage tp group"}


def test_embedding_defaults_and_refusals():
    emb = Embedding(10, 6)
    assert (emb.tp_rank, emb.tp_size, emb.sharding_dim, emb.vocab_start, emb.tp_dim("weight")) == (0, 1, None, 0, -1)
    assert emb.weight.shape == (10, 6) and emb.weight.dtype == torch.float32 and not emb.weight.requires_grad
    one = Embedding(10, 6, tp_size=1, sharding_dim=0)  # tp 1: nothing to shard
    assert one.sharding_dim is None and one.weight.shape == (10, 6)
    meta = Embedding(10, 6, torch.bfloat16, "meta", tp_rank=1, tp_size=2, sharding_dim=1)
    assert meta.weight.shape == (10, 3) and meta.weight.dtype == torch.bfloat16 and meta.weight.device.type == "meta"
    with pytest.raises(ValueError, match=r"^embedding_sharding_dim 2: expected 0 \(vocab\) or 1 \(hidden\)$"):
        Embedding(10, 6, tp_size=2, sharding_dim=2)
    with pytest.raises(ValueError, match=r"^vocab_size 9 is not divisible by tp_size 2 \(use_parallel_embedding, "
                                         r"embedding_sharding_dim 0\)$"):
        Embedding(9, 6, tp_size=2, sharding_dim=0)
    with pytest.raises(ValueError, match=r"^hidden_size 5 is not divisible by tp_size 2"):
        Embedding(10, 5, tp_size=2, sharding_dim=1)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2)])
def test_moe_ranks_sum_to_the_whole(monkeypatch, tp, ep):
    """tp ranks (ep groups of whole experts, each split over tp / ep; weights cut by test_moe_ep's rank_moe,
    not by the ranks' own placement) run forward one after another: each hands its partial to the
    all-reduce on its tp_group, the partials sum to the whole MoE, and the reduced result is what each rank
    returns."""
    g = torch.Generator().manual_seed(2)
    whole = MoE(6, 8, 4, 2)
    for p in whole.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(5, 6, generator=g)
    expected = whole(x)
    fake = FakeCollectives(monkeypatch, moe_module)
    ranks = [rank_moe(whole, tp, ep, r) for r in range(tp)]
    for rank in ranks:
        rank.tp_group = "stage tp group"
        rank(x)
    torch.testing.assert_close(sum(fake.sent), expected)
    fake.reduce()
    for rank in ranks:
        torch.testing.assert_close(rank(x), expected)
    assert fake.groups == {"stage tp group"}


def test_bf16_moe_equals_float32_within_rounding():
    """The weighted expert outputs (float32 routing weights) land in the bf16 output."""
    g = torch.Generator().manual_seed(4)
    moe = MoE(6, 8, 4, 2)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(5, 6, generator=g)
    half = MoE(6, 8, 4, 2, dtype=torch.bfloat16)
    half.load_state_dict({k: v.bfloat16() for k, v in moe.state_dict().items()})
    out = half(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), moe(x), rtol=5e-2, atol=5e-2)


def test_linear_adds_the_lora_delta_of_its_input():
    lin = Linear(4, 3, bias=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(2, 4)
    seen = []

    def lora(module, inp):
        seen.append((module, inp))
        return inp[:, :3] * 10

    torch.testing.assert_close(lin(x, lora), torch.nn.functional.linear(x, lin.weight, lin.bias) + x[:, :3] * 10)
    assert seen[0][0] is lin and seen[0][1] is x
    torch.testing.assert_close(lin(x, lambda m, i: None), lin(x))


def test_quantized_linear_asks_its_slot_for_every_split_dim_but_the_bias():
    """Linear.tp_dim of a quantized layer: the bias splits as a float layer's; the packed weight and its
    scales as the slot says, given the weight's dim and whether the layer is column-parallel."""
    class Slot:
        def __init__(self):
            self.asked = []

        def tp_dim(self, name, weight_dim, is_column):
            self.asked.append((name, weight_dim, is_column))
            return 7

    for parallel, weight_dim, bias_dim in ((Parallel.COLUMN, 0, 0), (Parallel.ROW, 1, -1),
                                           (Parallel.REPLICATED, -1, -1)):
        lin = Linear(8, 6, True, parallel, tp_size=2)
        lin.quant = slot = Slot()
        assert lin.tp_dim("bias") == bias_dim and slot.asked == []
        assert lin.tp_dim("weights_scaling_factor") == 7 and lin.tp_dim("weight") == 7
        is_column = parallel == Parallel.COLUMN
        assert slot.asked == [("weights_scaling_factor", weight_dim, is_column), ("weight", weight_dim, is_column)]
