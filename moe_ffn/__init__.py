"""moe_ffn: transformer feed-forward blocks.

A Mixture-of-Experts layer over a bank of gated FFN experts held in single batched tensors,
and the dense blocks (classic FFN, SwiGLU, GeGLU, ...) that are its one-expert case.
"""

from moe_ffn._memory import release_gradient_memory
from moe_ffn.activations import ACTIVATIONS
from moe_ffn.config import MoEConfig
from moe_ffn.dense import GLU, Bilinear, FeedForward, GatedFFN, GeGLU, ReGLU, SwiGLU
from moe_ffn.experts import GatedExperts, MLPExperts
from moe_ffn.grouped import grouped_linear
from moe_ffn.losses import load_balancing_loss, router_z_loss
from moe_ffn.moe import MoE, MoEStats, collect_aux_loss, pooled_load_balancing_loss, update_expert_biases
from moe_ffn.router import RouterOutput, TopKRouter
from moe_ffn.sizes import llama_intermediate_size

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "Bilinear",
    "FeedForward",
    "GLU",
    "GatedExperts",
    "GatedFFN",
    "GeGLU",
    "MLPExperts",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "ReGLU",
    "RouterOutput",
    "SwiGLU",
    "TopKRouter",
    "collect_aux_loss",
    "grouped_linear",
    "llama_intermediate_size",
    "load_balancing_loss",
    "pooled_load_balancing_loss",
    "release_gradient_memory",
    "router_z_loss",
    "update_expert_biases",
]
