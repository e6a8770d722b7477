"""Interop with transformers: modules, state dicts, safetensors checkpoints and configs.

    from_hf_module(hf_block)                    # MixtralSparseMoeBlock → MoE, LlamaMLP → GatedFFN, ...
    to_hf_state_dict(moe, "mixtral_v4")         # export in a transformers layout
    load_hf_state_dict(moe, sd, "v5", prefix)   # strict, all-or-nothing import
    load_hf_layer("ckpt_dir", layer=3)          # one layer's FFN from safetensors, reading only it
    MoEConfig.from_hf("ckpt_dir")               # = moe_config_from_hf

transformers itself is never imported: modules are recognised by class name, configs are read
as JSON. safetensors is needed only for the checkpoint loader.
"""

from moe_ffn.interop.hf_config import (
    DENSE_FAMILIES,
    MOE_FAMILIES,
    dense_config_from_hf,
    hf_num_layers,
    moe_config_from_hf,
    read_hf_config,
)
from moe_ffn.interop.hf_modules import SUPPORTED_MODULES, from_hf_module, hf_activation_name
from moe_ffn.interop.safetensors_io import checkpoint_keys, load_hf_layer, read_hf_layer_tensors
from moe_ffn.interop.state_dict import LAYOUTS, Layout, hf_keys, load_hf_state_dict, to_hf_state_dict

__all__ = [
    "DENSE_FAMILIES",
    "LAYOUTS",
    "Layout",
    "MOE_FAMILIES",
    "SUPPORTED_MODULES",
    "checkpoint_keys",
    "dense_config_from_hf",
    "from_hf_module",
    "hf_activation_name",
    "hf_keys",
    "hf_num_layers",
    "load_hf_layer",
    "load_hf_state_dict",
    "moe_config_from_hf",
    "read_hf_config",
    "read_hf_layer_tensors",
    "to_hf_state_dict",
]
