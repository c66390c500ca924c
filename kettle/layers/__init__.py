"""Building blocks shared by Kettle's model implementations.

- `attention`: the per-step token layout (`AttentionMetadata`, built once per forward) and `paged_attention`,
  dispatched to an `AttentionBackend` (`KETTLE_TUNING`'s `attention`: "sdpa" on CPU, "cuda" for CUDA tensors).
- `sdpa_attention`: the default backend, PyTorch SDPA over block-gathered contexts.
- `rotary`: RoPE tables (default, linear, dynamic NTK, llama3), gathered once per step.
- `norm`: RMSNorm. `linear`: dense projections, fused at load time (q/k/v, gate/up).
"""
