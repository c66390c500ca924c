"""LoRA adapters (PEFT checkpoints) loaded at start against the base model and attached to its projections.

`--lora-adapters` takes TGI's syntax: `name=path` or a Hub id (its name is the id), comma-separated. Each
adapter is checked against the base model before anything serves: its rank, its target modules, and the shape
of every matrix; a mismatch is a one-line error naming the adapter and the module. Adapters attach to the
projections of pre-norm decoder layers (`attn.qkv`, `attn.o_proj`, `mlp.gate_up`, `mlp.down`), whose fused
outputs hold PEFT's `q_proj|k_proj|v_proj` and `gate_proj|up_proj` side by side.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kettle.hub.adapters import AdapterError, AdapterSource
from kettle.layers.lora import LoraLinear, LoraRows, LoraWeights, out_features
from kettle.models.spec import ModelSpec

# PEFT module name -> (the Kettle projection of a layer, the slice of its output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn.qkv", 0),
    "k_proj": ("attn.qkv", 1),
    "v_proj": ("attn.qkv", 2),
    "o_proj": ("attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up", 0),
    "up_proj": ("mlp.gate_up", 1),
    "down_proj": ("mlp.down", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA checkpoint read into memory: its scale and its A/B matrices by (layer, PEFT module)."""

    name: str
    rank: int
    scale: float
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]


def read_adapter(name: str, folder: Path) -> Adapter:
    """The adapter in `folder` (adapter_config.json + adapter_model.safetensors or .bin)."""
    config = _config(name, folder)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    # rsLoRA scales by alpha / sqrt(r), plain LoRA by alpha / r (PEFT's rule).
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    a, b = {}, {}
    for key, tensor in _tensors(name, folder).items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter `{name}`: tensor `{key}` is not a LoRA matrix of a decoder layer")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGETS:
            raise AdapterError(f"adapter `{name}`: module `{module}` is not one Kettle attaches LoRA to ({_names()})")
        (a if which == "A" else b)[(layer, module)] = tensor.float()
    if set(a) != set(b):
        raise AdapterError(f"adapter `{name}`: modules {sorted(set(a) ^ set(b))} have only one of lora_A / lora_B")
    return Adapter(name, rank, scale, a, b)


def _config(name: str, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError(f"adapter `{name}`: no adapter_config.json in {folder}")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter `{name}`: peft_type {config.get('peft_type')} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    if any(unsupported.values()):
        raise AdapterError(f"adapter `{name}`: {', '.join(k for k, v in unsupported.items() if v)} not supported")
    return config


def _tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "adapter_model.safetensors")
    if (folder / "adapter_model.bin").is_file():
        return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise AdapterError(f"adapter `{name}`: no adapter_model.safetensors or adapter_model.bin in {folder}")


def _names() -> str:
    return ", ".join(TARGETS)


def attach_adapters(model: nn.Module, spec: ModelSpec, adapters: list[Adapter]) -> LoraRows:
    """Wraps the projections the adapters touch in LoraLinear (adapter i is index i) and returns the rows
    state the runner sets before each forward."""
    rows = LoraRows()
    layers = getattr(model, "layers", None)
    if layers is None or not all(_has_projections(layer) for layer in layers):
        raise AdapterError(f"LoRA adapters need pre-norm decoder layers; {spec.model_type} is not served with them")
    for index, adapter in enumerate(adapters):
        for layer_index, _ in sorted(adapter.a):
            if layer_index >= len(layers):
                raise AdapterError(f"adapter `{adapter.name}`: layer {layer_index} but the model has {len(layers)}")
        for layer_index, layer in enumerate(layers):
            for path in sorted({TARGETS[m][0] for (i, m) in adapter.a if i == layer_index}):
                _wrapped(layer, path, spec, rows).add(index, _weights(adapter, layer_index, layer, path, spec))
    model.lora_rows = rows
    return rows


def _has_projections(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
    return all(hasattr(attn, p) for p in ("qkv", "o_proj")) and all(hasattr(mlp, p) for p in ("gate_up", "down"))


def _wrapped(layer: nn.Module, path: str, spec: ModelSpec, rows: LoraRows | None) -> LoraLinear:
    """The layer's LoraLinear at `path` (`attn.qkv`), created around the projection on first use."""
    parent_name, _, attr = path.partition(".")
    parent = getattr(layer, parent_name)
    module = getattr(parent, attr)
    if not isinstance(module, LoraLinear):
        assert rows is not None
        module = LoraLinear(module, _slices(path, module, spec), rows)
        setattr(parent, attr, module)
    return module


def _slices(path: str, module: nn.Module, spec: ModelSpec) -> tuple[tuple[int, int], ...]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if path == "attn.qkv":
        return ((0, q), (q, kv), (q + kv, kv))
    if path == "mlp.gate_up":
        half = out_features(module) // 2
        return ((0, half), (half, half))
    return ((0, out_features(module)),)


def _weights(adapter: Adapter, layer: int, module: nn.Module, path: str, spec: ModelSpec) -> LoraWeights:
    """This adapter's matrices for the projection at `path` of `module` (layer number `layer`), checked against
    its shapes."""
    wrapped = _wrapped(module, path, spec, None)
    modules = [m for m, (p, _) in TARGETS.items() if p == path]
    in_features = _expected_in(path, module, spec)
    a_parts, b_parts = [], []
    for name, (_, width) in zip(modules, wrapped.slices, strict=True):
        a, b = adapter.a.get((layer, name)), adapter.b.get((layer, name))
        if a is not None and (a.shape != (adapter.rank, in_features) or b.shape != (width, adapter.rank)):
            raise AdapterError(
                f"adapter `{adapter.name}`, layers.{layer}.{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                f"do not fit the base model (expected ({adapter.rank}, {in_features}) / ({width}, {adapter.rank}))"
            )
        a_parts.append(None if a is None else a.to(spec.dtype))
        b_parts.append(None if b is None else b.to(spec.dtype))
    return LoraWeights(tuple(a_parts), tuple(b_parts), adapter.scale)


def _expected_in(path: str, layer: nn.Module, spec: ModelSpec) -> int:
    """The input width of the projection at `path` (down's is the MLP's inner width: half of gate_up's output)."""
    if path in ("attn.qkv", "mlp.gate_up"):
        return spec.hidden_size
    if path == "attn.o_proj":
        return spec.num_heads * spec.head_dim
    return out_features(layer.mlp.gate_up) // 2


def load_adapters(value: str | None, model: nn.Module, world_size: int) -> tuple[str, ...]:
    """Reads and attaches every adapter of `--lora-adapters`; returns their names, in index order."""
    sources = AdapterSource.parse_list(value)
    if not sources:
        return ()
    if world_size > 1:
        raise AdapterError("LoRA adapters are not served with tensor parallelism yet (--num-shard > 1)")
    if getattr(model, "execution_path", "native") != "native":
        raise AdapterError("LoRA adapters need a model Kettle implements natively, not one served through transformers")
    adapters = [read_adapter(s.name, s.folder()) for s in sources]
    attach_adapters(model, model.spec, adapters)
    return tuple(a.name for a in adapters)
