"""The DFlash v1 draft model.

A stack of Qwen3-style layers whose queries come from the block only
(``[anchor, MASK, ...]``) and whose keys/values are the target's context
features followed by the block itself. The draft has no embedding or LM head of
its own: the target's are used (see ``speculative.target``). Parameter names are
exactly those of the published checkpoints (``fc``, ``hidden_norm``, ``norm``,
``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp.*``, ...).
"""

from __future__ import annotations

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
from speculative.masks import attention_allowed


class DraftAttention(nn.Module):
    """Attention of one draft layer. The context's K/V come from outside (the
    draft cache, filled by ``DFlashDraftModel.context_kv``) with the same
    ``k_proj``/``v_proj``/``k_norm`` as the block's own K/V."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        arch = config.architecture
        self.head_dim = int(getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads)
        self.num_heads = int(arch.num_attention_heads)
        self.num_kv_heads = int(arch.num_key_value_heads)
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
    ) -> torch.Tensor:
        batch, q_len, _ = x.shape
        heads = (batch, q_len, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)
        v = self.v_proj(x).view(heads).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # The block's own K/V are used for this forward only and never cached.
        keys = torch.cat([context_k, k], dim=2)
        values = torch.cat([context_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: attention over [context; block], then SwiGLU MLP."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        arch = config.architecture
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = Qwen3MLP(arch)
        self.input_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, context_k, context_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """DFlash v1 draft: ``forward`` maps block embeddings to normed hidden states
    (apply the target's LM head to get logits); ``context_kv`` turns target
    features into every layer's context K/V with one fused projection."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        arch = config.architecture
        self.config = config
        hidden = int(arch.hidden_size)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=arch.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(arch)
        self._fused: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

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

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` [B, n] (negative positions of padding are clamped)."""
        return self.rotary_emb(x, positions.clamp(min=0))

    def context_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat of the target's selected layer outputs))``."""
        return self.hidden_norm(self.fc(target_features))

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
        attn0 = self.layers[0].self_attn
        kv = kv.view(batch, n, len(self.layers), 2, attn0.num_kv_heads, attn0.head_dim)
        keys = torch.stack([layer.self_attn.k_norm(kv[:, :, i, 0]) for i, layer in enumerate(self.layers)], dim=2)
        # [B, n, L, kvh, d] -> [B, L*kvh, n, d]: one RoPE call for every layer's keys.
        keys = keys.flatten(2, 3).transpose(1, 2)
        cos, sin = self.rope(c, positions)
        keys, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
        keys = keys.view(batch, len(self.layers), attn0.num_kv_heads, n, attn0.head_dim)
        values = kv[:, :, :, 1].permute(0, 2, 3, 1, 4)
        return [(keys[:, i], values[:, i]) for i in range(len(self.layers))]

    def _fused_kv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stacked ``[k_0; v_0; k_1; v_1; ...]`` weights (and biases).

        Under autograd they are concatenated afresh so gradients reach every
        projection; at inference they are cached and rebuilt only when a
        parameter changed (tensor version counter) or moved (data pointer).
        """
        projections = [p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
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
        h = block_embeddings
        for layer, (k, v) in zip(self.layers, context, strict=True):
            attention = layer.self_attn.attention
            if attention not in masks:
                allowed = attention_allowed(
                    block_positions, key_positions, causal=attention.causal, window=attention.window
                )
                masks[attention] = (allowed if visible is None else allowed & visible).unsqueeze(1)
            h = layer(h, rope, k, v, masks[attention])
        return self.norm(h)
