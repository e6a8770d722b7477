"""Load one layer's FFN from a transformers safetensors checkpoint, reading only its tensors.

A checkpoint directory holds `config.json` and either one `model.safetensors` or shards listed
in `model.safetensors.index.json` (key → file). The key names are read from the index or from
the file header; then each shard that holds a tensor of the layer is opened lazily with
`safe_open` and only those tensors are read, so loading layer 17 of Mixtral 8x22B does not
touch the other 55 layers.

The FFN block of layer i is found under `…layers.{i}.block_sparse_moe.` (Mixtral on disk),
`…layers.{i}.mlp.` (everything else, and checkpoints written in transformers v5's fused layout)
or `…h.{i}.mlp.` (GPT-2); the layout is recognised from the key names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Union

import torch
from torch import Tensor, nn

from moe_ffn.interop.hf_config import dense_config_from_hf, moe_config_from_hf, read_hf_config
from moe_ffn.interop.state_dict import load_hf_state_dict
from moe_ffn.presets import build_ffn

__all__ = ["load_hf_layer", "read_hf_layer_tensors", "checkpoint_keys", "safe_open"]

try:  # safetensors is an optional dependency (the `dev` extra); only this module needs it
    from safetensors import safe_open
except ImportError:  # pragma: no cover - exercised only without safetensors installed
    safe_open = None

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _require_safetensors() -> None:
    if safe_open is None:
        raise ImportError("loading safetensors checkpoints needs the `safetensors` package (pip install safetensors)")


def checkpoint_keys(checkpoint: Union[str, os.PathLike]) -> dict[str, Path]:
    """Every tensor name in the checkpoint and the file that holds it (headers only, no data)."""
    _require_safetensors()
    root = Path(checkpoint)
    index = root / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {key: root / name for key, name in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {root}")
    with safe_open(str(single), framework="pt") as f:
        return {key: single for key in f.keys()}


# The FFN block of layer i: a `layers.{i}.` or GPT-2 `h.{i}.` module followed by its FFN name.
_FFN_PREFIX = r"^((?:.*\.)?(?:layers|h)\.{i}\.(?:block_sparse_moe|mlp)\.)"


def _layer_prefix(keys, layer: int) -> str:
    pattern = re.compile(_FFN_PREFIX.format(i=layer))
    prefixes = sorted({m.group(1) for k in keys if (m := pattern.match(k))})
    if len(prefixes) != 1:
        found = "none" if not prefixes else prefixes
        raise KeyError(
            f"expected one FFN block for layer {layer} (keys like 'model.layers.{layer}.mlp.…', "
            f"'model.layers.{layer}.block_sparse_moe.…' or 'h.{layer}.mlp.…'), found {found}"
        )
    return prefixes[0]


def _detect_layout(relative_keys) -> str:
    keys = set(relative_keys)
    if "experts.gate_up_proj" in keys:
        return "v5"
    if any(re.fullmatch(r"experts\.\d+\.w[123]\.weight", k) for k in keys):
        return "mixtral_v4"
    if any(re.fullmatch(r"experts\.\d+\.(gate|up|down)_proj\.weight", k) for k in keys):
        return "qwen_moe_v4"
    if "gate_proj.weight" in keys:
        return "llama_mlp"
    if "c_fc.weight" in keys:
        return "gpt2_mlp"
    raise ValueError(
        f"unrecognised FFN layout with keys {sorted(keys)}; supported: transformers v5 fused experts, "
        "Mixtral w1/w2/w3, Qwen-MoE/OLMoE per-expert gate/up/down_proj, LLaMA-style gate/up/down_proj, "
        "GPT-2 c_fc/c_proj"
    )


def read_hf_layer_tensors(checkpoint: Union[str, os.PathLike], layer: int) -> tuple[dict[str, Tensor], str, str]:
    """Read the tensors of layer `layer`'s FFN block and nothing else.

    Returns: (tensors keyed relative to the FFN block, the block's key prefix, the layout).
    """
    _require_safetensors()
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be an int >= 0, got {layer!r}")
    files = checkpoint_keys(checkpoint)
    prefix = _layer_prefix(files, layer)
    wanted = [k for k in files if k.startswith(prefix)]
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    tensors = {}
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                tensors[key[len(prefix):]] = f.get_tensor(key)
    return tensors, prefix, _detect_layout(tensors)


def load_hf_layer(
    checkpoint: Union[str, os.PathLike], layer: int, *, device=None, dtype: torch.dtype | None = None
) -> nn.Module:
    """Build layer `layer`'s FFN from a transformers safetensors checkpoint directory.

    The module's config comes from the directory's `config.json` (`MoEConfig.from_hf` for
    MoE layers, `dense_config_from_hf` for dense ones); the layer's tensors are read and
    loaded strictly (see `load_hf_state_dict`).

    Args:
        checkpoint: directory with config.json and model.safetensors or a sharded index.
        layer: decoder layer index.
        device, dtype: of the module; dtype None keeps the checkpoint's dtype.
    Returns: a `MoE`, `GatedFFN` or `FeedForward`.
    """
    hf_config = read_hf_config(checkpoint)
    tensors, _, layout = read_hf_layer_tensors(checkpoint, layer)
    if layout in ("v5", "mixtral_v4", "qwen_moe_v4"):
        config = moe_config_from_hf(hf_config)
    else:
        config = dense_config_from_hf(hf_config)
    if dtype is None:
        dtype = next(iter(tensors.values())).dtype
    module = build_ffn(config, device=device, dtype=dtype)
    load_hf_state_dict(module, tensors, layout)
    return module
