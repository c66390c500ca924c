"""A GGUF file as a model folder: the one-time preparation behind the bundled model and any `.gguf` a user passes.

For the architectures Kettle reads natively from GGUF (`NATIVE_ARCHITECTURES`), only the small files are
written: config.json, generation_config.json, the tokenizer and its chat template (read by transformers with
the `gguf` package), plus a symbolic link `model.gguf` to the file itself. The shard then reads the weights
straight from the GGUF (kettle/tensors/gguf_file.py), still quantized: no float copy is ever written.

A vision-language model's projector file (`mmproj`, beside the GGUF or named by `--mmproj`) is linked too
(`mmproj.gguf`), and config.json becomes the vision family's (kettle/hub/mmproj_config.py); its vision tensors
are read from that file by kettle/tensors/mmproj_file.py.

Other architectures are converted as before: transformers dequantizes every weight and the result is saved
as a float32 safetensors folder. Everything torch or transformers is imported inside the functions, so
importing this module is free.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kettle.hub.failures import cause, first_line
from kettle.hub.types import PreparationError

# GGUF architectures whose weights Kettle's native families read straight from the file (tested in
# tests/models/test_gguf_native.py); the others are converted to a float32 safetensors folder.
NATIVE_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "starcoder2", "falcon", "gpt2", "bloom",
)  # fmt: skip
# The layer count of each Gemma generation's 27B model, the one trained with queries scaled by hidden / heads.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# What llama.cpp fixes for every Gemma 3 file (no metadata key): one global layer in 6, the sliding layers' RoPE
# base; and the converter's global base where a config has none.
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_GLOBAL_BASE = 6, 10_000.0, 1_000_000.0
GGUF_LINK = "model.gguf"  # the name under which a prepared folder points at its GGUF file
# Metadata llama.cpp's converter writes that transformers' GGUF reader leaves out of the config (transformers
# 5.x), which would otherwise keep its class default: StarCoder2's RoPE base (1e5 or more in the published
# models, default 1e4), Phi-3's sliding window, Gemma 2's soft caps (Gemma 3's final one, where a file sets it),
# GPT-2's number of positions.
UNMAPPED_METADATA = {
    "starcoder2": {"rope.freq_base": "rope_theta"},
    "phi3": {"attention.sliding_window": "sliding_window"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "gemma3": {"final_logit_softcapping": "final_logit_softcapping"},
    "gpt2": {"context_length": "n_positions"},
}

# What to do about a GGUF file that cannot be read.
_ANOTHER_COPY = "download it again or pass another model"

# Below this, `model_max_length` is a real limit; at or above it, transformers' "no limit known" sentinel.
_UNLIMITED = 10**18


def readable_architecture(gguf_path: Path) -> str:
    """`general.architecture` from the file's header; a `PreparationError` naming the file when it is not a GGUF
    file, is cut short within its header, or names no architecture."""
    from kettle.hub.gguf_header import read_header

    try:
        fields = read_header(gguf_path).fields
    except ValueError as error:  # worded by read_header: the file and what is wrong with it
        raise PreparationError(f"Cannot prepare the model: {error}; {_ANOTHER_COPY}") from error
    except OSError as error:
        why = cause(error.errno, error.filename) if error.errno else first_line(error)
        raise PreparationError(f"Cannot read the model file {gguf_path}: {why}") from error
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise PreparationError(
            f"Cannot prepare the model: {gguf_path} names no architecture (general.architecture); {_ANOTHER_COPY}"
        )
    return arch


def check_complete(gguf_path: Path) -> None:
    """Before a first preparation: a `PreparationError` naming the file when its tensors run past its end (a
    download cut short) or are of a type gguf does not know, instead of transformers' traceback halfway through the
    preparation (or the shard's, when it maps the weights)."""
    import math

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kettle.hub.gguf_header import read_header

    size, end = gguf_path.stat().st_size, 0
    for tensor in read_header(gguf_path).tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.qtype)]
        except (ValueError, KeyError):
            raise PreparationError(
                f"Cannot prepare the model: {gguf_path} stores tensor {tensor.name!r} in ggml type {tensor.qtype}, "
                f"which this version of gguf does not know (a corrupt file, or a newer type); {_ANOTHER_COPY}"
            ) from None
        end = max(end, tensor.offset + math.prod(tensor.dims) // block * block_bytes)
    if end > size:
        raise PreparationError(
            f"Cannot prepare the model: {gguf_path} is truncated (its tensors end at byte {end:,}, the file has "
            f"{size:,}); {_ANOTHER_COPY}"
        )


def prepare_gguf(gguf_path: Path, out_dir: Path, trust_remote_code: bool = False, mmproj: Path | None = None) -> None:
    """Writes config.json, generation_config.json, the tokenizer files and a `model.gguf` link into `out_dir`; with
    `mmproj`, the vision-language model's config and image processor settings, and a `mmproj.gguf` link."""
    from kettle.hub.gguf_alias import read_as_alias
    from kettle.hub.mmproj import MMPROJ_LINK

    with _metadata_read_once(), read_as_alias():
        config = save_config(gguf_path, out_dir, trust_remote_code)
        _save_tokenizer(gguf_path, out_dir, trust_remote_code, context_length=_context_length(config))
    _add_legacy_config_keys(out_dir / "config.json")
    (out_dir / GGUF_LINK).symlink_to(gguf_path.resolve())
    if mmproj is not None:
        from kettle.hub.mmproj_config import write_vision_config

        write_vision_config(gguf_path, mmproj, out_dir)
        (out_dir / MMPROJ_LINK).symlink_to(mmproj.resolve())


def convert_gguf(gguf_path: Path, out_dir: Path, trust_remote_code: bool = False) -> None:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer files into `out_dir`."""
    try:
        model = _save_model(gguf_path, out_dir, trust_remote_code)
    except ValueError as error:
        # transformers' own list of GGUF architectures decides (it maps several spellings); its error says only
        # "GGUF model with architecture X is not supported yet", naming no file.
        if "architecture" not in str(error) or "not supported" not in str(error):
            raise
        raise PreparationError(
            f"Cannot prepare the model: {gguf_path} holds a {readable_architecture(gguf_path)!r} model, which neither "
            f"Kettle ({', '.join(NATIVE_ARCHITECTURES)}) nor transformers reads from GGUF; pass another model"
        ) from error
    _save_tokenizer(gguf_path, out_dir, trust_remote_code, context_length=_context_length(model.config))
    _add_legacy_config_keys(out_dir / "config.json")


@contextmanager
def _metadata_read_once() -> Iterator[None]:
    """transformers parses a GGUF's whole metadata for the config, and again for the tokenizer's config (~3 s
    each for the bundled file, most of a first start); inside the block the second parse is the first's result.
    Only metadata reads (`return_tensors=False`) are shared; each caller gets its own copy to change."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, parsed = gguf_utils.load_gguf_checkpoint, {}

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors, **kwargs)
        if str(path) not in parsed:
            with _plain_arrays():
                parsed[str(path)] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    gguf_utils.load_gguf_checkpoint = load_once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


@contextmanager
def _plain_arrays() -> Iterator[None]:
    """`gguf.GGUFReader` maps the file as an `np.memmap`, whose `__getitem__` and `__array_finalize__` are Python
    code, and its metadata parse slices it once per item of every array: 1.8 million slices for the bundled
    model's vocabulary and merges, ~3 s of a 7 s preparation. Inside the block the reader gets a plain ndarray view
    of the same mapping, sliced in C; the values read are the same bytes. Its arrays of strings and numbers are
    also cut into their items in one pass (`_array_parts`) instead of a recursive call and four NumPy views per
    item: the same parts, as memoryviews (strings) and NumPy slices (numbers); 2.9 s → ~0.2 s on the bundled file.
    transformers' parse then decodes each string item's bytes at once (`parse`)."""
    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    numpy = gguf_reader.np
    reader = gguf_reader.GGUFReader
    field_parts = reader._get_field_parts

    class PlainMapping:
        """numpy for the reader's module, except that `memmap` returns an ndarray view of the mapping."""

        def __getattr__(self, name: str):
            return getattr(numpy, name)

        @staticmethod
        def memmap(*args, **kwargs):
            return numpy.memmap(*args, **kwargs).view(numpy.ndarray)

    def parts(self, offset: int, raw_type: int):
        return _array_parts(self, offset, raw_type) or field_parts(self, offset, raw_type)

    parse_value = gguf_utils._gguf_parse_value

    def parse(value, types):
        # An array's string item as `_array_parts` cuts it: its bytes decoded at once, where transformers' parse
        # makes a list of their ints, an array of that and bytes of the array (the same UTF-8 decode).
        return str(value, "utf-8") if type(value) is memoryview else parse_value(value, types)

    gguf_reader.np, reader._get_field_parts, gguf_utils._gguf_parse_value = PlainMapping(), parts, parse
    try:
        yield
    finally:
        gguf_reader.np, reader._get_field_parts, gguf_utils._gguf_parse_value = numpy, field_parts, parse_value


def _array_parts(reader, offset: int, raw_type: int) -> tuple | None:
    """`GGUFReader._get_field_parts` for a flat array of strings or numbers in a native-order file: (size, parts,
    data indices, types) as it returns them, each string's length and bytes as memoryviews (what transformers'
    parse reads of them: `[0]`, the bytes, `nbytes`), each number as a one-item slice of the whole array. None for
    anything else (a scalar, a nested array, a byte-swapped file), which the reader parses itself."""
    import numpy as np
    from gguf import GGUFValueType

    if raw_type != GGUFValueType.ARRAY or reader.byte_order != "I":
        return None
    item_type, count = reader._get(offset, np.uint32), reader._get(offset + 4, np.uint64)
    item, n, start = GGUFValueType(int(item_type[0])), int(count[0]), offset + 12
    parts: list = [item_type, count]
    if item == GGUFValueType.STRING:
        view, end, indices = memoryview(reader.data), start, []
        for _ in range(n):
            size = int.from_bytes(view[end : end + 8], "little")
            parts += (view[end : end + 8].cast("Q"), view[end + 8 : end + 8 + size])
            indices.append(len(parts) - 1)
            end += 8 + size
    elif item in reader.gguf_scalar_to_np:
        values = reader._get(start, reader.gguf_scalar_to_np[item], n)
        parts += [values[i : i + 1] for i in range(n)]
        indices, end = list(range(2, 2 + n)), start + int(values.nbytes)
    else:
        return None
    return end - offset, parts, indices, [GGUFValueType.ARRAY, item] if n else [GGUFValueType.ARRAY]


def save_config(gguf_path: Path, out_dir: Path, trust_remote_code: bool = False):
    """Writes config.json and generation_config.json as transformers reads them from the file's metadata."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=trust_remote_code)
    # transformers marks configs read from GGUF as "quantized with gguf"; Kettle reads the file itself.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    _add_unmapped_metadata(gguf_path, config)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    return config


def _add_unmapped_metadata(gguf_path: Path, config) -> None:
    """Sets what the metadata says and transformers' reader left out: `UNMAPPED_METADATA`, Falcon's layout."""
    from kettle.hub.gguf_header import read_header

    header = read_header(gguf_path)
    fields, arch = header.fields, header.fields["general.architecture"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv")
    if arch == "falcon" and kv_heads and kv_heads > 1:
        # transformers reads every Falcon as the 7B (one KV head, one norm): several KV heads are the 40B/180B/11B
        # layout, with separate attention and MLP norms where the file has the second one (attn_norm_2).
        config.new_decoder_architecture, config.num_kv_heads = True, int(kv_heads)
        two_norms = any(tensor.name == "blk.0.attn_norm_2.weight" for tensor in header.tensors)
        config.num_ln_in_parallel_attn = 2 if two_norms else 1
    if arch == "phi3":
        _add_long_context_factors(gguf_path, header, config)
    if arch in GEMMA_27B_LAYERS:
        config.query_pre_attn_scalar = gemma2_query_scalar(
            config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim, arch
        )
    if arch == "gemma3":
        _add_gemma3_layers(gguf_path, fields, config)
    for key, attribute in UNMAPPED_METADATA.get(arch, {}).items():
        value = fields.get(f"{arch}.{key}")
        if value is None:
            continue
        if attribute == "rope_theta":  # transformers 5 keeps it in `rope_parameters`
            config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": float(value)}
        elif attribute == "sliding_window":
            config.sliding_window = int(value) or None  # llama.cpp writes 0 for "no window" (Phi-4)
        else:
            setattr(config, attribute, value)


def gemma2_query_scalar(layers: int, hidden: int, heads: int, head_dim: int, arch: str = "gemma2") -> float:
    """What Gemma 2 and 3 divide queries by (the square root of it): the head size, except for the 27B models,
    trained with hidden / heads (Gemma 2's 144, Gemma 3's 168; their head size is 128). The metadata has no key for
    it, so llama.cpp tells a 27B by its layers (`GEMMA_27B_LAYERS`); transformers' reader leaves the class default
    (256, right for the smaller models only)."""
    return hidden / heads if layers == GEMMA_27B_LAYERS[arch] else head_dim


def _add_gemma3_layers(gguf_path: Path, fields: dict, config) -> None:
    """Gemma 3's layer types and its two RoPE tables, as llama.cpp reads the file: the metadata has neither the
    sliding-window pattern nor the local base, which llama.cpp fixes (every 6th layer global, the others sliding;
    local base 10,000, unscaled), and transformers' reader maps only the global base; the file's linear scaling
    (factor 8 in the 4B-27B models) applies to the global layers only."""
    window = fields.get("gemma3.attention.sliding_window")
    config.layer_types = [
        "full_attention" if not window or i % GEMMA3_PATTERN == GEMMA3_PATTERN - 1 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    ]
    full = {"rope_type": "default", "rope_theta": float(fields.get("gemma3.rope.freq_base", GEMMA3_GLOBAL_BASE))}
    factor = fields.get("gemma3.rope.scaling.factor") or fields.get("gemma3.rope.scale_linear")
    if factor and float(factor) != 1.0:
        kind = fields.get("gemma3.rope.scaling.type", "linear")
        if kind not in ("linear", "none"):  # llama.cpp scales Gemma 3's positions linearly whatever else is set
            raise PreparationError(
                f"Cannot prepare the model: {gguf_path} sets RoPE scaling {kind!r} on Gemma 3, which is served with "
                "linear scaling only (the published models'); pass another model"
            )
        full |= {"rope_type": "linear", "factor": float(factor)}
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_BASE}
    config.rope_parameters = {"full_attention": full, "sliding_attention": local}


def _add_long_context_factors(gguf_path: Path, header, config) -> None:
    """Phi-3's long-context RoPE ("longrope", the 128k models): llama.cpp stores the per-frequency factors as two
    tensors and the trained length as metadata, none of which transformers' reader maps."""
    import numpy as np

    tensors = {t.name: t for t in header.tensors}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    original = header.fields.get("phi3.rope.scaling.original_context_length")
    if long is None or short is None or not original:
        return

    def values(tensor) -> list[float]:
        if tensor.qtype != 0:  # F32, as the converter writes them
            raise ValueError(f"{tensor.name} is not float32 (ggml type {tensor.qtype})")
        count = int(np.prod(tensor.dims))
        return np.fromfile(gguf_path, dtype=np.float32, count=count, offset=tensor.offset).tolist()

    config.rope_parameters = {
        **(config.rope_parameters or {}),
        "rope_type": "longrope",
        "long_factor": values(long),
        "short_factor": values(short),
        "original_max_position_embeddings": int(original),
    }
    config.original_max_position_embeddings = int(original)


def _save_model(gguf_path: Path, out_dir: Path, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    # The weights are already dequantized to float32, but transformers still marks the model as "quantized
    # with gguf" and refuses to save it; what we write is a plain float checkpoint, so drop the marks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    return model


def _save_tokenizer(gguf_path: Path, out_dir: Path, trust_remote_code: bool, context_length: int | None) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=trust_remote_code
    )
    # GGUF carries no tokenizer length limit; without one the router could not derive --max-input-tokens.
    if context_length and tokenizer.model_max_length >= _UNLIMITED:
        tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir / "tokenizer_config.json", tokenizer.chat_template)


def _embed_chat_template(tokenizer_config: Path, template: str | dict | None) -> None:
    """Also keeps the chat template inside tokenizer_config.json, where TGI-era readers look for it.

    Recent transformers writes it only to chat_template.jinja; the copy here costs nothing and makes the
    folder readable by every reader of the usual lookup order (chat_template.json, .jinja, tokenizer_config.json).
    """
    if not template or not tokenizer_config.exists():
        return
    settings = json.loads(tokenizer_config.read_text())
    settings.setdefault("chat_template", template)
    tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _context_length(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def _add_legacy_config_keys(config_path: Path) -> None:
    """Mirrors `rope_parameters.rope_theta` as a top-level `rope_theta`, the key older configs use.

    transformers 5 nests it; model code written against published checkpoints reads the top-level key.
    """
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
