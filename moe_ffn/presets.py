"""Named FFN presets: small TOML files read with the standard library.

A preset file describes one model family's FFN layer and how many layers the model has:

    name = "mixtral-8x7b"
    num_layers = 32
    [moe]              # or [dense] with kind = "gated" | "classic"
    dim = 4096
    hidden_dim = 14336
    num_experts = 8
    top_k = 2

Keys under [moe] are `MoEConfig` fields, under [dense] `DenseConfig` fields. Presets live in
the top-level `configs/` folder (shipped inside the package as `moe_ffn.configs`);
`load_preset("mixtral-8x7b")` finds one by name, `load_preset("path/to/file.toml")` by path.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from torch import nn

from moe_ffn.config import DenseConfig, MoEConfig

__all__ = ["Preset", "load_preset", "available_presets", "build_ffn"]

_SOURCE_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class Preset:
    name: str
    num_layers: int
    ffn: Union[MoEConfig, DenseConfig]
    description: str = ""

    def build_layer(self, *, device=None, dtype=None) -> nn.Module:
        return build_ffn(self.ffn, device=device, dtype=dtype)


def build_ffn(config: MoEConfig | DenseConfig, *, device=None, dtype=None) -> nn.Module:
    """The module a config describes: MoE, GatedFFN or FeedForward."""
    from moe_ffn.dense import FeedForward, GatedFFN
    from moe_ffn.moe import MoE

    if isinstance(config, MoEConfig):
        return MoE(config, device=device, dtype=dtype)
    if config.kind == "gated":
        return GatedFFN(config.dim, config.hidden_dim, config.bias, config.dropout,
                        activation=config.activation, device=device, dtype=dtype)
    return FeedForward(config.dim, config.hidden_dim, config.activation, config.bias, config.dropout,
                       device=device, dtype=dtype)


def _preset_dirs() -> list[Path]:
    dirs = [_SOURCE_DIR] if _SOURCE_DIR.is_dir() else []
    try:
        packaged = Path(str(importlib.resources.files("moe_ffn") / "configs"))
        if packaged.is_dir():
            dirs.append(packaged)
    except (ModuleNotFoundError, TypeError):
        pass
    return dirs


def available_presets() -> list[str]:
    return sorted({p.stem for d in _preset_dirs() for p in d.glob("*.toml")})


def _check_keys(where: str, table: dict, valid: list[str]) -> None:
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(valid)}")


def load_preset(name_or_path: str | Path) -> Preset:
    """Read a preset by name (see `available_presets()`) or from a TOML file path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        candidates = [d / f"{name_or_path}.toml" for d in _preset_dirs()]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise ValueError(f"unknown preset {str(name_or_path)!r}; available: {available_presets()}")
    if not path.is_file():
        raise FileNotFoundError(f"preset file not found: {path}")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    where = str(path)
    _check_keys(where, data, ["name", "description", "num_layers", "moe", "dense"])
    if ("moe" in data) == ("dense" in data):
        raise ValueError(f"{where}: needs exactly one of the tables [moe] or [dense]")
    cls, table = (MoEConfig, data["moe"]) if "moe" in data else (DenseConfig, data["dense"])
    _check_keys(f"{where} [{'moe' if cls is MoEConfig else 'dense'}]", table, [f.name for f in dataclasses.fields(cls)])
    num_layers = data.get("num_layers", 1)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{where}: num_layers must be a positive int, got {num_layers!r}")
    return Preset(
        name=data.get("name", path.stem),
        num_layers=num_layers,
        ffn=cls(**table),
        description=data.get("description", ""),
    )
