"""What Kettle can serve, read from a model folder's `config.json` without torch.

The launcher checks a model before it starts any shard (a clear line instead of a shard traceback), and it
must stay light: it never imports torch or transformers' model code. So the facts it needs live here, as
plain data: which `model_type`s have a native implementation (and in which module), which of those split
over tensor-parallel shards, which `--quantize` values run where, and which model types transformers knows.
The shard's registry loads its families from the same table.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """A native implementation: `kettle.models.<module>.<cls>`; `no_tensor_parallel`, when set, says why it
    cannot load per-rank slices (the launcher's one-line refusal of --num-shard > 1)."""

    module: str
    cls: str
    no_tensor_parallel: str | None = None

    @property
    def tensor_parallel(self) -> bool:
        return self.no_tensor_parallel is None


# Model types transformers' own code serves: it loads every weight whole on one process.
FALLBACK_REASON = "it has no native implementation (transformers' own code serves it, whole on one process)"

_LLAMA = Family("llama", "LlamaForCausalLM")
_FALCON = Family("falcon", "FalconForCausalLM")

# model_type → family; aliases are the model_types older configs carry.
NATIVE: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gpt2": Family("gpt2", "GPT2ForCausalLM"),
    "gpt_bigcode": Family("gpt_bigcode", "GPTBigCodeForCausalLM"),
    "opt": Family("opt", "OPTForCausalLM"),
    "bloom": Family("bloom", "BloomForCausalLM"),
    "mpt": Family("mpt", "MptForCausalLM"),
    "falcon": _FALCON,
    "RefinedWeb": _FALCON,
    "RefinedWebModel": _FALCON,
    "gemma2": Family("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": Family("gemma3", "Gemma3ForCausalLM"),
    "mixtral": Family("mixtral", "MixtralForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM"),
    "gemma": Family("gemma", "GemmaForCausalLM"),
    "phi": Family("phi", "PhiForCausalLM"),
    "phi3": Family("phi3", "Phi3ForCausalLM"),
    "gptj": Family("gptj", "GPTJForCausalLM"),
    "llava": Family("llava", "LlavaForConditionalGeneration"),  # the tower and projector whole on every rank
    "idefics3": Family("idefics3", "Idefics3ForConditionalGeneration"),  # the same: the tower whole on every rank
    "llava_next": Family("llava_next", "LlavaNextForConditionalGeneration"),  # the same
    "qwen2_vl": Family("qwen2_vl", "Qwen2VLForConditionalGeneration"),  # the same
    "gemma3": Family("gemma3_vlm", "Gemma3ForConditionalGeneration"),  # the same
    "qwen2_5_vl": Family("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),  # the same
    "gpt_neox": Family("gpt_neox", "GPTNeoXForCausalLM"),
    "starcoder2": Family("starcoder2", "Starcoder2ForCausalLM"),
}

# `--quantize` values: weight-only schemes for the CPU (and, opted in, NVIDIA GPUs), fp8 on NVIDIA GPUs, and
# TGI's other values, accepted by the flag's vocabulary and refused with a clear message (`check_scheme`).
CPU_SCHEMES = ("int8", "int4", "gptq", "awq")
CUDA_SCHEMES = ("fp8",)
UNSUPPORTED = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "marlin", "exl2")
ALL_SCHEMES = CPU_SCHEMES + CUDA_SCHEMES + UNSUPPORTED


def read_config(path: str | Path) -> dict:
    """The folder's config.json as a dict ({} when there is none: the loaders report that in their words)."""
    config_file = Path(path) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def check_tensor_parallel(model_type: str, world_size: int) -> None:
    """Refuses a sharded run of a model type that cannot split, in one line naming it and the reason."""
    if world_size <= 1:
        return
    family = NATIVE.get(model_type)
    reason = FALLBACK_REASON if family is None else family.no_tensor_parallel
    if reason is not None:
        raise ValueError(
            f"model type {model_type!r} does not support tensor parallelism (--num-shard {world_size}): {reason}; "
            "run it with --num-shard 1"
        )


def check_tensor_parallel_folder(path: str, world_size: int) -> None:
    """`check_tensor_parallel` for a model folder, from its config.json (the launcher's check, before any shard)."""
    check_tensor_parallel(read_config(path).get("model_type", "unknown"), world_size)


def check_loadable(path: str, trust_remote_code: bool) -> None:
    """Raises ValueError with an actionable message when neither Kettle nor transformers could load `path` as
    asked: custom code (`auto_map`) without `--trust-remote-code`, or a type nobody knows."""
    settings = read_config(path)
    model_type = settings.get("model_type")
    known = transformers_model_types()
    if not settings or model_type in NATIVE or known is None or model_type in known:
        return  # served natively or by transformers' own code (a shipped auto_map is ignored without the flag)
    if settings.get("auto_map"):
        if not trust_remote_code:
            raise ValueError(
                f"model type {model_type!r} needs the custom code shipped with the model (config.json auto_map): "
                "pass --trust-remote-code to run it"
            )
        return
    raise ValueError(
        f"model type {model_type!r} has no native implementation and is unknown to transformers "
        f"{importlib.metadata.version('transformers')} (no auto_map in config.json): it cannot be served"
    )


@functools.cache
def transformers_model_types() -> frozenset[str] | None:
    """The model types the installed transformers has config classes for, or None when they cannot be read.

    Read from transformers' generated table of config names, and its model folders, as files, not by import:
    importing any of transformers' auto classes imports torch (~1.5 s and memory the launcher should not hold).
    """
    spec = importlib.util.find_spec("transformers")
    folders = spec.submodule_search_locations if spec else None
    table = Path(next(iter(folders))) / "models" / "auto" / "auto_mappings.py" if folders else None
    names = _config_names(table) if table is not None and table.is_file() else None
    if not names:
        return None
    # A few aliases are registered in code, not in the table ("gpt-sw3"): their model folder counts.
    models = [path.name for path in table.parent.parent.iterdir()]
    return frozenset(names) | {*models, *(name.replace("_", "-") for name in models)}


def _config_names(table: Path) -> list[str]:
    """The keys of `CONFIG_MAPPING_NAMES = OrderedDict([("model_type", "ConfigClass"), ...])` in `table`."""
    for node in ast.parse(table.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CONFIG_MAPPING_NAMES":
            pairs = ast.literal_eval(node.value.args[0]) if isinstance(node.value, ast.Call) else ()
            return [model_type for model_type, _ in pairs]
    return []


def check_scheme(quantize: str | None, device_type: str) -> None:
    """Raises a ValueError naming the working alternatives when `quantize` cannot run on `device_type`."""
    if quantize is None:
        return
    cpu = ", ".join(CPU_SCHEMES)
    if quantize not in ALL_SCHEMES:
        raise ValueError(f"--quantize {quantize} is unknown: use one of {', '.join(ALL_SCHEMES)}")
    if quantize in UNSUPPORTED:
        raise ValueError(
            f"--quantize {quantize} is not supported by Kettle (it needs CUDA kernels Kettle does not ship): "
            f"on the CPU use --quantize int8 or int4 (or serve a GPTQ/AWQ checkpoint: {cpu}); "
            "on an NVIDIA Hopper GPU use --quantize fp8"
        )
    if quantize in CUDA_SCHEMES and device_type != "cuda":
        raise ValueError(
            f"--quantize {quantize} needs an NVIDIA GPU (Hopper or newer): on the CPU use --quantize int8 or int4 "
            f"(or serve a GPTQ/AWQ checkpoint with {cpu}), or run without --quantize with --dtype float32 "
            "(the CPU default) or --dtype bfloat16"
        )
    if quantize in CPU_SCHEMES and device_type not in ("cpu", "cuda"):
        raise ValueError(f"--quantize {quantize} runs on the CPU and on NVIDIA GPUs only, not on {device_type}")
