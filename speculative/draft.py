"""The DFlash v1 draft model.

A stack of Qwen3-style layers whose queries come from the block only
(``[anchor, MASK, ...]``) and whose keys/values are the target's context
features followed by the block itself. The draft has no embedding or LM head of
its own: the target's are used (see ``speculative.target``). Parameter names are
exactly those of the published checkpoints (``fc``, ``hidden_norm``, ``norm``,
``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp.*``, ...).

A draft may carry a reduced draft vocabulary (FR-Spec / EAGLE-3 style): the
buffer ``draft_vocab_ids``, K sorted target token ids, saved with the weights.
It then proposes only those tokens, with those K rows of the target's LM head,
so its head costs K/V of the full one. Verification never reads the map, so the
output stays exactly the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from speculative.config import DFlashConfig, LayerAttention
from speculative.masks import RowSpan, attention_allowed, by_spans, row_spans
from speculative.ngram_table import NgramTable
from speculative.packed import pack_linears, pack_weight, packed_linear, packing_support
from speculative.target import TargetModel

VOCAB_IDS_NAME = "draft_vocab_ids"


def check_draft_vocab_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``ids`` as a valid reduced draft vocabulary (1-D int64) for a ``vocab_size``
    vocabulary, or ``ValueError``: K >= 1 distinct ids in ``[0, vocab_size)``,
    sorted ascending, so that a draft index maps to a target id by one lookup
    and a target id to a draft index by binary search."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft_vocab_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"draft_vocab_ids must lie in [0, {vocab_size}), got ids from {int(ids.min())} to {int(ids.max())}"
        )
    unordered = (ids[1:] <= ids[:-1]).nonzero()
    if len(unordered):
        i = int(unordered[0])
        raise ValueError(
            f"draft_vocab_ids must be sorted and distinct: id {int(ids[i + 1])} at index {i + 1} follows {int(ids[i])}"
        )
    return ids


class DraftAttention(nn.Module):
    """Attention of one draft layer. The context's K/V come from outside (the
    draft cache, filled by ``DFlashDraftModel.context_kv``) with the same
    ``k_proj``/``v_proj``/``k_norm`` as the block's own K/V."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        arch = config.architecture
        self.head_dim = int(getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads)
        self.num_heads = int(arch.num_attention_heads)
        # Qwen3Config replaces a missing num_key_value_heads by num_attention_heads.
        self.num_kv_heads = int(cast(int, arch.num_key_value_heads))
        self.attention = config.layer_attention[layer_idx]
        bias = bool(arch.attention_bias)
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=arch.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
        spans: tuple[RowSpan, ...] | None = None,
    ) -> torch.Tensor:
        batch, q_len, _ = x.shape
        heads = (batch, q_len, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        # The block's own K/V are used for this forward only and never cached. Span by span
        # (``speculative.masks.row_spans``), no row reads or copies a longer neighbour's padding.
        def attend(rows: slice, first: int) -> torch.Tensor:
            keys = torch.cat([context_k[rows, :, first:], k[rows]], dim=2)
            values = torch.cat([context_v[rows, :, first:], v[rows]], dim=2)
            masked = mask[rows, ..., first:]
            return F.scaled_dot_product_attention(q[rows], keys, values, attn_mask=masked, enable_gqa=True)

        out = by_spans(spans, batch, attend)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))
        return projected


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: attention over [context; block], then SwiGLU MLP."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        arch = config.architecture
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = Qwen3MLP(arch)  # type: ignore[no-untyped-call]  # transformers' Qwen3MLP.__init__ is unannotated
        self.input_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
        spans: tuple[RowSpan, ...] | None = None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, context_k, context_v, mask, spans)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class DFlashDraftModel(nn.Module):
    """DFlash v1 draft: ``forward`` maps block embeddings to normed hidden states
    (``draft_logits`` applies the target's LM head, or the draft vocabulary's
    rows of it); ``context_kv`` turns target features into every layer's context
    K/V with one fused projection.

    ``draft_vocab_ids`` must be given exactly when the config declares a
    ``draft_vocab_size`` (and then have that many ids)."""

    draft_vocab_ids: torch.Tensor | None

    def __init__(self, config: DFlashConfig, draft_vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        arch = config.architecture
        self.config = config
        hidden = int(arch.hidden_size)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(arch)
        self._fused: tuple[tuple[object, ...], torch.Tensor, torch.Tensor | None] | None = None
        self._head: tuple[tuple[object, ...], torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self._pack_head = False
        # Shipped beside the weights (``speculative.ngram_table``); lookup paths read it.
        self.ngram_table: NgramTable | None = None
        self.register_buffer(VOCAB_IDS_NAME, None)
        if draft_vocab_ids is None and config.draft_vocab_size is not None:
            raise ValueError(f"the config declares draft_vocab_size {config.draft_vocab_size} but no draft_vocab_ids")
        if draft_vocab_ids is not None:
            if config.draft_vocab_size != draft_vocab_ids.numel():
                declared = "declares none" if config.draft_vocab_size is None else f"says {config.draft_vocab_size}"
                raise ValueError(
                    f"draft_vocab_ids has {draft_vocab_ids.numel()} ids but the config's draft_vocab_size {declared}"
                )
            self.set_draft_vocab(draft_vocab_ids)

    @property
    def block_size(self) -> int:
        """The block size the draft was trained with."""
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        """Target vocabulary row used for the block's MASK slots."""
        return self.config.mask_token_id

    @property
    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """Causality and window of each layer."""
        return self.config.layer_attention

    def pack_linears(self) -> str:
        """For serving on a CPU: pack the draft's linear weights and its
        draft-vocabulary head once (``speculative.packed``), where this device
        and dtype allow. Returns what happened, for the log."""
        reason = packing_support(self.fc.weight.device, self.fc.weight.dtype)
        if reason:
            return f"not packed: {reason}"
        self._pack_head, self._head = True, None
        return f"{pack_linears(self)} linears packed (oneDNN)"

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Propose only from target tokens ``ids`` from now on (None: from all of
        them); the config's ``draft_vocab_size`` follows, so a save records it."""
        if ids is not None:
            ids = check_draft_vocab_ids(ids, int(self.config.architecture.vocab_size)).to(self.fc.weight.device)
        self.config = self.config.with_draft_vocab_size(None if ids is None else ids.numel())
        self.draft_vocab_ids = ids
        self._head = None

    def draft_logits(self, hidden: torch.Tensor, target: TargetModel, *, full_vocab: bool = True) -> torch.Tensor:
        """Logits of the draft's normed ``hidden`` states [..., H].

        Without a draft vocabulary: exactly ``target.lm_head(hidden)``. With
        one: only its K rows of the LM head are multiplied (the saving), giving
        [..., K] logits in draft-index order when ``full_vocab`` is False
        (training), else scattered into full-vocabulary logits with -inf for
        every other token (serving), so penalties, warping and verification
        work unchanged and a sampled proposal is zero outside the subset,
        which rejection sampling allows.
        """
        if self.draft_vocab_ids is None:
            return target.lm_head(hidden)
        head: nn.Linear = target.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        weight, bias, packed = self._draft_head(head)
        # As one 2-D GEMM: a strided [..., H] input (block slots past the anchor)
        # would otherwise run as a batched matmul over a broadcast weight, ~3x slower.
        flat = hidden.reshape(-1, hidden.shape[-1])
        rows = F.linear(flat, weight, bias) if packed is None else packed_linear(flat, packed, bias)
        logits = rows.view(*hidden.shape[:-1], -1)
        if not full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], head.weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab_ids, logits)

    def _draft_head(self, head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The draft vocabulary's rows of the LM head ``head``, its bias, and
        the rows packed for the CPU (``pack_linears`` asked for it; else None).

        Cached, and sliced afresh only when the head's weight or the map changed
        (tensor version counter) or moved (data pointer), or inference mode was
        switched (a slice made in inference mode cannot enter autograd). Not
        cached when autograd must reach the head (grad enabled and the head
        trainable), nor for tensors made in inference mode (no version counter).
        """
        ids = self.draft_vocab_ids
        weight: torch.Tensor = head.weight
        bias: torch.Tensor | None = head.bias
        tensors = [t for t in (weight, bias, ids) if t is not None]
        needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        cacheable = not needs_graph and not any(t.is_inference() for t in tensors)
        key = (torch.is_inference_mode_enabled(), *((t._version, t.data_ptr()) for t in tensors)) if cacheable else ()
        if cacheable and self._head is not None and self._head[0] == key:
            return self._head[1:]
        weight, bias = weight[ids], (bias[ids] if bias is not None else None)
        if cacheable:
            self._head = (key, weight, bias, pack_weight(weight) if self._pack_head else None)
            return self._head[1:]
        return weight, bias, None

    def draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary index of each target token id, -1 for tokens outside
        the draft vocabulary (identity without one). A binary search over the
        sorted map: no vocabulary-sized table."""
        ids = self.draft_vocab_ids
        if ids is None:
            return token_ids
        index = torch.searchsorted(ids, token_ids).clamp(max=len(ids) - 1)
        return torch.where(ids[index] == token_ids, index, -1)

    def target_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Target token id of each draft-vocabulary index (identity without a map)."""
        return draft_index if self.draft_vocab_ids is None else self.draft_vocab_ids[draft_index]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` [B, n] (negative positions of padding are clamped)."""
        cos_sin: tuple[torch.Tensor, torch.Tensor] = self.rotary_emb(x, positions.clamp(min=0))
        return cos_sin

    def context_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat of the target's selected layer outputs))``."""
        features: torch.Tensor = self.hidden_norm(self.fc(target_features))
        return features

    def context_kv(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context K/V of every layer for new context tokens.

        ``target_features`` [B, n, n_feat*H], ``positions`` [B, n]. Context K/V do not
        depend on earlier draft layers, so all layers' ``k_proj``/``v_proj`` run as ONE
        GEMM over stacked weights; then each layer's ``k_norm`` and a single RoPE pass
        over all layers' keys. Returns ``[(k, v)]`` per layer, each [B, kv_heads, n, d].
        """
        c = self.context_features(target_features)
        weight, bias = self._fused_kv_weight()
        kv = F.linear(c, weight, bias)
        batch, n, _ = c.shape
        layers = self.draft_layers()
        attn0 = layers[0].self_attn
        kv = kv.view(batch, n, len(layers), 2, attn0.num_kv_heads, attn0.head_dim)
        keys = torch.stack([layer.self_attn.k_norm(kv[:, :, i, 0]) for i, layer in enumerate(layers)], dim=2)
        # [B, n, L, kvh, d] -> [B, L*kvh, n, d]: one RoPE call for every layer's keys.
        keys = keys.flatten(2, 3).transpose(1, 2)
        cos, sin = self.rope(c, positions)
        keys, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
        keys = keys.view(batch, len(layers), attn0.num_kv_heads, n, attn0.head_dim)
        values = kv[:, :, :, 1].permute(0, 2, 3, 1, 4)
        return [(keys[:, i], values[:, i]) for i in range(len(layers))]

    def _fused_kv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stacked ``[k_0; v_0; k_1; v_1; ...]`` weights (and biases).

        Under autograd they are concatenated afresh so gradients reach every
        projection; at inference they are cached and rebuilt only when a
        parameter changed (tensor version counter) or moved (data pointer).
        """
        projections = [p for layer in self.draft_layers() for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        tensors = [t for p in projections for t in p.parameters()]
        # Parameters created under inference mode have no version counter: no caching.
        cacheable = not torch.is_grad_enabled() and not any(t.is_inference() for t in tensors)
        key = tuple((t._version, t.data_ptr()) for t in tensors) if cacheable else ()
        if cacheable and self._fused is not None and self._fused[0] == key:
            return self._fused[1], self._fused[2]
        weight = torch.cat([p.weight for p in projections], dim=0)
        bias = torch.cat([p.bias for p in projections], dim=0) if projections[0].bias is not None else None
        if cacheable:
            self._fused = (key, weight, bias)
        return weight, bias

    def forward(
        self,
        block_embeddings: torch.Tensor,
        block_positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        context_positions: torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the draft over one block per row.

        ``block_embeddings`` [B, b, H] (target embeddings of ``[anchor, MASK...]``,
        already scaled), ``block_positions`` [B, b], ``context`` per-layer cached
        (k, v) [B, kvh, T, d], ``context_positions`` [B, T] (-1 marks a slot to
        ignore). ``visible`` [B, q, T + q], when given, further restricts which
        keys each query sees (training packs many blocks into one row). Returns
        normed hidden states [B, q, H]; slot j predicts the token at
        ``block_positions[:, j]``.
        """
        rope = self.rope(block_embeddings, block_positions)
        key_positions = torch.cat([context_positions, block_positions], dim=1)
        masks: dict[LayerAttention, torch.Tensor] = {}
        spans = row_spans(context_positions)
        h = block_embeddings
        for layer, (k, v) in zip(self.draft_layers(), context, strict=True):
            attention = layer.self_attn.attention
            if attention not in masks:
                allowed = attention_allowed(
                    block_positions, key_positions, causal=attention.causal, window=attention.window
                )
                masks[attention] = (allowed if visible is None else allowed & visible).unsqueeze(1)
            h = layer(h, rope, k, v, masks[attention], spans)
        normed: torch.Tensor = self.norm(h)
        return normed

    def draft_layers(self) -> Sequence[DraftLayer]:
        """``self.layers``, which holds only ``DraftLayer``s (``nn.ModuleList`` types its items as ``Module``)."""
        return cast(Sequence[DraftLayer], self.layers)
