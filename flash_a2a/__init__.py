"""FlashAttention fused with the Ulysses post-attention All-to-All.

- ``flash_attention``: our persistent Hopper attention (CuTe DSL, WGMMA, warp-specialized), one GPU;
- ``fused_attention_a2a`` / ``FusedAttentionA2A``: the same kernel with a piggybacked epilogue that stores
  each output tile straight into its destination rank's symmetric buffer;
- ``UlyssesAttention``: drop-in for yunchang's module;
- ``SymmetricUlyssesA2A``: the post-attention All-to-All alone, by device-initiated stores.
"""
from flash_a2a.a2a import SymmetricUlyssesA2A, nccl_post_a2a
from flash_a2a.api import FusedAttentionA2A, flash_attention, fused_attention_a2a
from flash_a2a.config import AttentionConfig, resolve_config
from flash_a2a.ulysses import UlyssesAttention, pre_attention_a2a

__all__ = ["AttentionConfig", "FusedAttentionA2A", "SymmetricUlyssesA2A", "UlyssesAttention", "flash_attention",
           "fused_attention_a2a", "nccl_post_a2a", "pre_attention_a2a", "resolve_config"]
