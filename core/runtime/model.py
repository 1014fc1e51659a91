"""The generic decoder-only language model every architecture builds on.

    ids [T] -> transformer.vocab_embedding -> transformer.layers[*] -> transformer.ln_f
            -> lm_head (last token of each sequence, or every token) -> logits [B or T, V]

An architecture subclasses `DecoderLM` and provides `make_layer` and `make_final_norm`;
extra top-level modules (learned positions, input/output projections) come from
`make_top_level_modules`, which the default `embed` / `logits` already run:

    x = vocab_embedding(ids) -> project_in (if any) -> * embedding_scale -> + position_embedding(positions)
        -> ln_embed (if any)
    logits = lm_head(project_out(ln_f(x)))                       (project_out if any)
    logits = c tanh(logits / c)                                  with a final-logit soft-cap c (Gemma 2)

Module paths equal checkpoint names, so a rank file loads with `load_state_dict`. Under
pipeline parallelism a rank holds only its stage's layers (local indices 0..n-1, global
index = `layer_offset` + local).
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.format.config import PretrainedConfig
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.embedding import Embedding
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.moe import ExpertLinear

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a config dtype string."""
    return TORCH_DTYPES[name]


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global indices of the layers of pipeline stage `pp_rank` (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def last_tokens(meta: AttentionMetadata) -> torch.Tensor:
    """meta.last_token_index [B]: where each sequence's last new token is among the packed ones."""
    if meta.last_token_index is None:
        raise ValueError("AttentionMetadata without last_token_index (AttentionMetadata.build sets it)")
    return meta.last_token_index


class Transformer(nn.Module):
    """Container whose attribute names are the checkpoint's `transformer.*` sections."""

    vocab_embedding: Embedding  # the first pipeline stage only
    layers: nn.ModuleList  # this stage's decoder layers
    ln_f: nn.Module  # the last pipeline stage only


def sequence_metadata(model: DecoderLM, tokens: list[int], start: int, count: int, blocks: list[int],
                      block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of one sequence's step over tokens[start:start + count] (`start` tokens already cached in
    `blocks`), with the architecture's position ids and mask (e.g. ChatGLM v1's 2D positions and prefix)."""
    return AttentionMetadata.build(
        [count], [start], [blocks], block_size, positions=model.position_ids(tokens, start, count), device=device,
        mask=model.mask_kind, prefix_lens=[model.prefix_len(tokens)] if model.mask_kind != "causal" else None,
    )


class DecoderLM(nn.Module):
    """Embedding + decoder layers + final norm + lm_head for one (tp, pp) rank."""

    lm_head: Linear  # the last pipeline stage, unless it shares the embedding (shares_embedding)

    def __init__(self, config: PretrainedConfig, rank: int = 0, device: torch.device | str | None = "meta") -> None:
        super().__init__()
        mapping = config.mapping
        self.config = config
        self.rank = rank
        self.tp_rank, self.tp_size = mapping.tp_rank(rank), mapping.tp_size
        self.pp_rank, self.pp_size = mapping.pp_rank(rank), mapping.pp_size
        self.dtype = torch_dtype(config.dtype)
        layers = pp_layer_range(config.num_hidden_layers, self.pp_size, self.pp_rank)
        self.layer_offset = layers.start
        self.is_first_stage, self.is_last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.transformer = Transformer()
        if self.is_first_stage:
            self.transformer.vocab_embedding = Embedding(
                config.vocab_size, self.embedding_dim, self.dtype, device, self.tp_rank, self.tp_size,
                config.embedding_sharding_dim if config.use_parallel_embedding else None)
        self.transformer.layers = nn.ModuleList(self.make_layer(i, device) for i in layers)
        self._set_attention_windows(layers)
        for name, module in self.make_top_level_modules(device).items():
            setattr(self.transformer, name, module)  # named and quantized below like every other module
        if self.is_last_stage:
            self.transformer.ln_f = self.make_final_norm(device)
            if not self.shares_embedding:
                if config.vocab_size % self.tp_size:
                    raise ValueError(f"vocab_size {config.vocab_size} is not divisible by tp_size {self.tp_size}")
                self.lm_head = Linear(self.embedding_dim, config.vocab_size, bias=False, parallel=Parallel.COLUMN,
                                      tp_rank=self.tp_rank, tp_size=self.tp_size, dtype=self.dtype, device=device)
        for name, module in self.named_modules():
            if isinstance(module, (Linear, ExpertLinear)):
                module.name = name
        from bestiary.core.quant.apply import install_quantization

        install_quantization(self, config)  # packed weights + scales where config.quantization says

    def attention_window(self, layer_idx: int) -> int:
        """Sliding window of global layer `layer_idx` (0: full attention): by default the config's
        `sliding_window`, on the layers its `layer_types` marks "sliding_attention" when it has that
        list (core.kernels.attention_window.layer_window). Override for another rule."""
        from bestiary.core.kernels.attention_window import layer_window

        return layer_window(self.config, layer_idx)

    def _set_attention_windows(self, layers: range) -> None:
        """Give every PagedAttention of each layer that layer's window."""
        from bestiary.core.layers.attention import PagedAttention

        for idx, layer in zip(layers, self.transformer.layers):
            for module in layer.modules():
                if isinstance(module, PagedAttention):
                    module.window = self.attention_window(idx)

    @property
    def attention_windows(self) -> list[int]:
        """The window (0: none) of every local layer's attention, in order (the KV cache releases a
        block only once it is outside all of them)."""
        from bestiary.core.layers.attention import PagedAttention

        return [m.window for m in self.transformer.layers.modules() if isinstance(m, PagedAttention)]

    # --- what an architecture provides -------------------------------------------------
    def make_layer(self, layer_idx: int, device) -> nn.Module:
        """The decoder layer of global index `layer_idx`: forward(x, meta, k_pool, v_pool) -> x."""
        raise NotImplementedError

    def make_final_norm(self, device) -> nn.Module:
        """The final norm (transformer.ln_f)."""
        raise NotImplementedError

    def make_top_level_modules(self, device) -> dict[str, nn.Module]:
        """Extra `transformer.<name>` modules of this rank's stage, e.g. {"position_embedding": ...}.

        Called once in the constructor after the layers, before Linear names are set and
        quantization is installed, so these modules are named, quantized and TP-sliced like any
        other. Build input-side modules only when `self.is_first_stage`, output-side ones only
        when `self.is_last_stage`. The default `embed` / `logits` run the standard names:
        `project_in` (after the token embedding), `position_embedding` (added, called with
        meta.positions), `ln_embed` (a norm of the sum), `project_out` (before lm_head).
        """
        return {}

    def placement(self, device) -> dict:
        """The keyword arguments every core layer takes: tp_rank, tp_size, dtype, device."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "dtype": self.dtype, "device": device}

    def make_rotary(self, style: str | None = None):
        """The rotary of the config's `rotary_base`, `rotary_scaling`, `rotary_pct` (defaults 10000, None, 1)
        over `head_size`: style "gptj" for position_embedding_type rope_gptj, else "neox"; ChatGLM v1's
        two-dimensional rotary (core.layers.rotary_2d) for position_embedding_type chatglm."""
        from bestiary.core.layers.rotary import Rotary
        from bestiary.core.layers.rotary_2d import Rotary2D

        c = self.config
        head_size = c.head_size
        assert head_size is not None, "PretrainedConfig's validator fills head_size in"
        base, positions = getattr(c, "rotary_base", 10000.0), c.max_position_embeddings or 2048
        if c.position_embedding_type == "chatglm":
            return Rotary2D(head_size, base, positions)
        pct = getattr(c, "rotary_pct", 1.0)
        style = style or ("gptj" if c.position_embedding_type == "rope_gptj" else "neox")
        return Rotary(head_size, int(head_size * pct) // 2 * 2, base, getattr(c, "rotary_scaling", None),
                      positions, style=style)

    embedding_scale: float | None = None  # x = embedding * this (e.g. sqrt(hidden_size)), when set
    default_pooling: str = "last"  # embeddings (core.runtime.pooling): a family may set "mean"
    logit_softcap: float | None = None  # logits = c tanh(logits / c) with this c, when set (Gemma 2)

    @property
    def embedding_dim(self) -> int:
        """Width of the token embedding and of lm_head's input: hidden_size, unless the
        architecture projects in and out of it (OPT-350m's word_embed_proj_dim)."""
        return self.config.hidden_size

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether lm_head reuses the input embedding (override from the config)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def shares_embedding(self) -> bool:
        """lm_head is the embedding tensor itself (tied, one tp rank, one stage): no lm_head.weight.

        A quantized lm_head is never shared: it is a quantized copy of the tied embedding
        (the embedding stays float for the lookup)."""
        from bestiary.core.quant.modes import quantizes

        return (self.tie_word_embeddings and self.tp_size == 1 and self.pp_size == 1
                and not quantizes("lm_head", self.config.quantization))

    def source_aliases(self) -> dict[str, str]:
        """Canonical keys filled from another canonical key's source (tied lm_head on TP/PP)."""
        if self.tie_word_embeddings and not self.shares_embedding and self.is_last_stage:
            return {"lm_head.weight": "transformer.vocab_embedding.weight"}
        return {}

    # Attention mask kind of this architecture: "causal", or "prefix_lm" (bidirectional
    # over the first `prefix_len(tokens)` tokens of a sequence, e.g. ChatGLM v1).
    mask_kind: str = "causal"

    def prefix_len(self, tokens: list[int]) -> int:
        """Length of the bidirectional prefix of a sequence (prefix_lm only)."""
        return 0

    def position_ids(self, tokens: list[int], start: int, count: int) -> torch.Tensor:
        """Position ids [count] (or [2, count]) of tokens[start:start+count] of a sequence.

        `tokens` is the whole sequence so far (prompt + output). Default: start..start+count-1.
        """
        return torch.arange(start, start + count, dtype=torch.int64)

    def embed(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """ids [T] -> hidden [T, H]: the token embedding [T, E], then the standard top-level
        modules this model has (project_in E -> H, embedding_scale, + position_embedding, ln_embed)."""
        x = self.transformer.vocab_embedding(ids)  # [T, E]
        project_in = getattr(self.transformer, "project_in", None)
        if project_in is not None:
            x = project_in(x)  # [T, H]
        if self.embedding_scale is not None:  # rounded to the embedding dtype first, as transformers' Gemma does
            x = x * float(torch.tensor(self.embedding_scale, dtype=x.dtype))
        positions = getattr(self.transformer, "position_embedding", None)
        if positions is not None:
            x = x + positions(meta.positions)  # [T, H]
        ln_embed = getattr(self.transformer, "ln_embed", None)
        if ln_embed is not None:
            x = ln_embed(x)  # [T, H]: a norm of the embeddings (BLOOM's word_embeddings_layernorm)
        return x

    # --- inference ---------------------------------------------------------------------
    tp_group = None  # the process group of this rank's tp collectives (None: the default world)

    def use_tp_group(self, group) -> None:
        """Run every tp collective of this model (Linear, Embedding, MoE, the logits gather) on
        `group`: a pipeline stage's own tp ranks (core.runtime.pipeline.stage_tp_group)."""
        for module in self.modules():
            if hasattr(type(module), "tp_group"):
                module.tp_group = group

    def prepare_for_inference(self, part: nn.Module | None = None) -> None:
        """Fusions and packed layouts, once the weights are loaded. With `part` (a layer whose weights were
        just assigned: Engine.load prepares each layer as it is read, so its sources are freed before the
        next is read), that part's modules; without, every module not prepared yet, then the lm_head's
        layout. Each module is fused once."""
        done: set[int] = self.__dict__.setdefault("_prepared", set())
        for module in (part if part is not None else self).modules():
            fuse = getattr(module, "fuse", None)
            if module is not self and fuse is not None and id(module) not in done:
                done.add(id(module))
                fuse()
        if part is None:
            self._hold_lm_head()

    _lm_head_t: torch.Tensor | None = None  # [H, V_local] contiguous, CPU float weights only
    _lm_head_tiles: torch.Tensor | None = None  # [V_local, H] in row tiles, CPU bf16 weights (cpu_matmul)

    def _hold_lm_head(self) -> None:
        """On the CPU, hold a float lm_head weight [V, H] in row tiles (bfloat16, cpu_matmul.tiles_fit)
        or as the view of a contiguous [H, V] tensor.

        logits = x W^T then streams W one tile at a time (cpu_matmul.matmul_tiled), or W^T row by
        row: with V = 49152, batch 1, W^T reads ~23 GB/s in fp32 and bf16 where F.linear(x, W)
        reaches ~17 and ~11 (measured here). The parameter keeps its shape (a tied embedding looks
        its rows up in the tiles or the view), so nothing is held twice.
        """
        if not self.is_last_stage:
            return
        owner = self.transformer.vocab_embedding if self.shares_embedding else self.lm_head
        weight = owner.weight
        if getattr(owner, "quant", None) is not None or weight.device.type != "cpu" or not weight.is_floating_point():
            return
        if getattr(owner, "_tiles", None) is not None:  # an lm_head Linear already in tiles (Linear.fuse)
            self._lm_head_tiles = owner._tiles
        elif cpu_matmul.tiles_fit(weight):
            self._lm_head_tiles = owner._tiles = cpu_matmul.hold_tiled(owner)
        else:
            self._lm_head_t = cpu_matmul.hold_transposed(owner.weight)  # a float lm_head Linear's is already: no copy

    def tied_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] = hidden @ embedding^T: the lm_head of a model that shares its embedding
        (shares_embedding). A method of its own so that calibration can read its input as lm_head's
        (core.convert.calibration.collect_linear_inputs)."""
        return torch.nn.functional.linear(hidden, self.transformer.vocab_embedding.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> (project_out, if any: [N, E]) -> logits [N, V] in logits_dtype (gathered over tp ranks),
        soft-capped by logit_softcap when set."""
        project_out = getattr(self.transformer, "project_out", None)
        if project_out is not None:
            hidden = project_out(hidden)  # [N, E]
        if self._lm_head_tiles is not None:
            # [N, H] x [V, H]^T, the float32 sums stored in logits_dtype as a decode plan's lm_head does
            out = cpu_matmul.matmul_tiled(hidden, self._lm_head_tiles, out_dtype=torch_dtype(self.config.logits_dtype))
        elif self._lm_head_t is not None:
            out = cpu_matmul.matmul_t(hidden, self._lm_head_t)  # [N, H] @ [H, V]
        elif self.shares_embedding:
            out = self.tied_head(hidden)
        else:
            out = self.lm_head(hidden)  # a plain or quantized Linear
        if self.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, out, group=self.tp_group)
            out = torch.cat(parts, dim=-1)
        out = out.to(torch_dtype(self.config.logits_dtype))
        if self.logit_softcap is not None:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out

    def forward(
        self,
        ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCacheLike,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """ids [T] -> logits [B, V] of each sequence's last token ([T, V] with all_logits).

        Under pipeline parallelism every rank runs its stage (core.runtime.pipeline): the logits
        come back on global rank 0, the others return None."""
        if self.pp_size > 1:
            from bestiary.core.runtime.pipeline import pipeline_forward

            return pipeline_forward(self, ids, meta, kv_cache, all_logits)
        plan = None if all_logits else self._decode_plan(ids, meta, kv_cache)
        if plan is not None:
            return plan.run(ids, meta)  # the whole step in one compiled call (core.runtime.cpu_plan)
        graph = self._cuda_graph(ids, meta, kv_cache) if ids.is_cuda and not all_logits else None
        if graph is not None:
            return graph.run(ids, meta)  # the whole step in one graph replay (core.runtime.cuda_graph)
        return self.eager_forward(ids, meta, kv_cache, all_logits)

    def eager_forward(self, ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCacheLike,
                      all_logits: bool = False) -> torch.Tensor:
        """The step layer by layer from Python (what a decode plan or a CUDA graph replays in one call)."""
        x = self.embed(ids, meta)  # [T, H]
        for i, layer in enumerate(self.transformer.layers):
            x = layer(x, meta, kv_cache.k[i], kv_cache.v[i])
        if not all_logits:
            x = x.index_select(0, last_tokens(meta))  # [B, H]
        x = self.transformer.ln_f(x)
        if meta.keep_hidden:  # embeddings pool these rows (core.runtime.pooling)
            meta.hidden = x
        return self.logits(x)

    def _cuda_graph(self, ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCacheLike):
        """The captured CUDA graph of this decode step's batch size (core.runtime.cuda_graph), or None."""
        from bestiary.core.runtime.cuda_graph import graph_for

        return graph_for(self, ids, meta, kv_cache)

    def decode_plan_status(self) -> str | None:
        """None when CPU decode steps of this model can run as one compiled plan (core.runtime.cpu_plan),
        else why they run eagerly (an override, a top-level module, a layer the plan lacks, ...)."""
        from bestiary.core.runtime.cpu_plan import refusal

        return refusal(self) or self.__dict__.get("decode_plan_refusal")

    def _decode_plan(self, ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCacheLike):
        """The compiled CPU plan for this decode step (core.runtime.cpu_plan), built once per batch size
        and KV cache; None when the step or the model is not one a plan runs, or the kernel
        dispatch mode is not "auto" (checked every step: kernels_mode("torch") runs eagerly)."""
        if not meta.is_decode or ids.device.type != "cpu" or dispatch.mode() != "auto":
            return None
        plans = self.__dict__.setdefault("_decode_plans", {})  # batch -> DecodePlan | None
        b = len(meta.seq_lens)
        if b not in plans or (plans[b] is not None and not plans[b].same_pools(kv_cache.k, kv_cache.v)):
            from bestiary.core.runtime.cpu_plan import plan_for

            like = max((p for p in plans.values() if p is not None), key=lambda p: p.batch, default=None)
            plans[b] = plan_for(self, b, list(kv_cache.k), list(kv_cache.v), like=like)  # like resized if it can be
        plan = plans[b]
        return plan if plan is not None and plan.fits(meta) else None


class KVCacheLike:  # pragma: no cover - typing aid
    """Per-layer pools: k[i], v[i] of shape [num_blocks, block_size, KVH, D]."""

    k: torch.Tensor
    v: torch.Tensor
