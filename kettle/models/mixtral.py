"""Mixtral over a paged KV cache: the Mistral block with a sparse mixture-of-experts MLP.

Routing follows transformers: softmax over the router logits in float32, the top-k experts per token, their
probabilities renormalised to sum to one. The experts run token-grouped: tokens are sorted by expert once
per layer, and each expert with any tokens does one batched SiLU-gated MLP over its rows (a loop over the
experts, never over tokens), its outputs weighted and scattered back with one index_add.

Checkpoints name experts either the original way (`block_sparse_moe.experts.{e}.w1/w2/w3`, w1 = gate,
w3 = up, w2 = down, which transformers still writes) or transformers v5's fused 3-D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); both load.

Under tensor parallelism the router is replicated (every rank routes the same tokens to the same experts)
and each expert's inner dimension is split over the ranks: a rank holds its rows of every expert's gate/up
and the matching columns of its down; the weighted sum of the experts' partial outputs is all-reduced once
per layer, not once per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.kernels import ops
from kettle.layers.linear import Linear
from kettle.layers.parallel import projection, split_range
from kettle.models.blocks import GatedMLP
from kettle.models.llama import LlamaForCausalLM
from kettle.tensors.weights import Weights


def load_experts(weights: Weights, prefix: str, num_experts: int, hidden_act: str) -> tuple[str, list[GatedMLP]]:
    """(router weight name, one gated MLP per expert) under a layer's `prefix`, from either naming; each
    expert's down projection returns this rank's partial sum (`SparseMoE` reduces them)."""
    legacy = f"{prefix}.block_sparse_moe"
    if weights.has(f"{legacy}.gate.weight"):
        experts = [
            GatedMLP.load(weights, f"{legacy}.experts.{e}", hidden_act, names=("w1", "w3", "w2"), reduce=False)
            for e in range(num_experts)
        ]
        return f"{legacy}.gate.weight", experts
    gate_up, down = weights.get(f"{prefix}.mlp.experts.gate_up_proj"), weights.get(f"{prefix}.mlp.experts.down_proj")
    inner = down.shape[2]
    start, stop = split_range(inner, weights.tp)  # all of it unsharded
    rows = torch.cat([torch.arange(start, stop), torch.arange(inner + start, inner + stop)]).to(gate_up.device)
    experts = [
        GatedMLP(
            projection(weights, gate_up[e, rows].contiguous(), None),
            projection(weights, down[e, :, start:stop].contiguous(), None),
            hidden_act,
        )
        for e in range(num_experts)
    ]
    return f"{prefix}.mlp.gate.weight", experts


class SparseMoE(nn.Module):
    """Top-k routed experts: sum over the chosen experts of weight × expert(x)."""

    def __init__(self, weights: Weights, prefix: str, config) -> None:
        super().__init__()
        router, experts = load_experts(weights, prefix, config.num_local_experts, config.hidden_act)
        router_weight = weights.get(router)
        self.router = Linear(router_weight)
        # The router as float32 rows [E, hidden] for the fused CPU decode step (the Linear may be oneDNN-packed,
        # which has no rows to read); a few KB per layer.
        self.register_buffer("router_rows", router_weight.float().contiguous(), persistent=False)
        self.experts = nn.ModuleList(experts)
        self.top_k = config.num_experts_per_tok
        self.tp = weights.tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their renormalised probabilities [T, k] (float32)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.tp.all_reduce(self._dense(x, experts, weights))
        return self.tp.all_reduce(self._grouped(x, experts, weights))

    def _dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert over every row, weighted by a [T, E] routing matrix that is zero off the top-k.

        Used while a decode CUDA graph is captured: the grouped path sizes its groups on the host, which a
        graph cannot replay; a decode batch is small, and the graph saves far more launch time than the
        extra expert rows cost.
        """
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * dense[:, e, None]).to(x.dtype)
        return out

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; each expert runs once over its own rows."""
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token_of = order // self.top_k  # the token each sorted (token, choice) pair belongs to
        # One host sync per layer for the group sizes; the loop below is over experts, not tokens.
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = token_of[start : start + count]
                scale = weights.flatten()[order[start : start + count], None]
                with ops.gathered_rows(rows):  # its prompt and decode rows each by their kind (batch invariance)
                    out.index_add_(0, rows, (expert(x[rows]) * scale).to(x.dtype))
            start += count
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral built directly from a checkpoint's tensors: Mistral's layers around routed experts."""

    def load_mlp(self, weights: Weights, prefix: str, config) -> SparseMoE:
        return SparseMoE(weights, prefix, config)
