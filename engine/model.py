"""The Llama / Qwen2 decoder, tensor-parallel by construction.

The forward takes tensors only (token ids and positions, flattened over the batch); paging
and batch layout come from the attention context (``engine.context``). The two families
differ only in their biases: Qwen2 has q/k/v biases, Llama optionally biases on all four
attention projections.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine import ops
from pdserve.engine.config import ModelConfig
from pdserve.engine.context import get_context
from pdserve.engine.layers import ColumnParallelLinear, Embedding, RMSNorm, RotaryEmbedding, RowParallelLinear
from pdserve.engine.parallel import TensorParallel, head_shard, split_range


class Attention(nn.Module):
    """GQA self-attention over this rank's heads; K/V live in the paged cache."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        shard = head_shard(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        d = config.head_dim
        self.head_dim = d
        self.num_heads, self.num_kv_heads = shard.num_q_heads, shard.num_kv_heads
        # Local query head h uses local KV head h // (num_heads // num_kv_heads), as on one rank.
        self.scale = d**-0.5
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [
                ("q", shard.q_start * d, shard.q_end * d),
                ("k", shard.kv_start * d, shard.kv_end * d),
                ("v", shard.kv_start * d, shard.kv_end * d),
            ],
            bias=config.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            shard.q_start * d, shard.q_end * d, config.hidden_size, bias=config.o_bias, dtype=dtype, tp=tp
        )
        self.rotary = rotary
        # Bound by the model runner once the KV pool exists: [num_blocks, block_size, Hkv, D].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        cos_sin = self.rotary.cos_sin_cache
        if ctx.is_decode:  # RoPE and the K/V store happen inside the decode attention
            out = ops.paged_decode_attention(
                q,
                k,
                v,
                positions,
                cos_sin,
                self.k_cache,
                self.v_cache,
                ctx.slot_mapping,
                ctx.block_tables,
                ctx.context_lens,
                self.scale,
                ctx.max_context_len,
            )
        else:
            q, _ = ops.rope_and_store_kv(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, ctx.slot_mapping)
            out = ops.paged_prefill_attention(
                q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.block_tables, ctx.context_lens, self.scale
            )
        return self.o_proj(out.reshape(num_tokens, q_size))


class MLP(nn.Module):
    """SwiGLU; the intermediate dimension splits (unevenly if need be) across ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        start, end = split_range(config.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [("gate", start, end), ("up", start, end)], bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(start, end, config.hidden_size, bias=config.mlp_bias, dtype=dtype, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op for gate/up and the gate: at one row the linear kernel applies it (kernels.linear).
        gate_up = self.gate_up_proj
        return self.down_proj(ops.linear_silu_and_mul(x, gate_up.weight, gate_up.bias))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, tp, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, tp, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (``model.layers.N...``, ``lm_head``)."""

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.rotary = RotaryEmbedding(config.head_dim, max_position, config.rope)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, tp, self.rotary, dtype) for _ in range(config.num_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Replicated LM head: one vocab matmul per rank beats a gather of vocab shards for these sizes.
        self.lm_head = None if config.tie_word_embeddings else Embedding(config.vocab_size, config.hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids and positions -> ``[T, hidden]`` final hidden states."""
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` fp32 logits, written into ``out`` when given (the
        CUDA graphs' one logits buffer) or a new tensor. The LM head's kernels store them in
        fp32 themselves (ops.linear's ``out``), the same way for both."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if out is None:
            out = torch.empty((hidden.shape[0], head.weight.shape[0]), dtype=torch.float32, device=hidden.device)
        return ops.linear(hidden, head.weight, out=out)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
