"""A projector file's (`mmproj-*.gguf`, llama.cpp's) vision tensors under the Hugging Face names the native
vision families read, dense float32 (the tower is small, and its numbers go straight into the prompt).

llama.cpp's converters (convert_hf_to_gguf.py's MmprojModel classes, and the older
convert_image_encoder_to_gguf.py that wrote the LLaVA projectors still published) rename every tensor to
`v.*` (the encoder) and `mm.*` (the projector), and change a few on the way; reading them back undoes that:
- Qwen2-VL's and Qwen2.5-VL's patch embedding, a Conv3d over two frames, is split into two Conv2d kernels
  (`v.patch_embd.weight`, `v.patch_embd.weight.1`): they are stacked back along the frame axis;
- their fused `attn.qkv` is split into `attn_q`, `attn_k` and `attn_v`: the rows are joined again;
- the older converter named each CLIP layer's fc1 `ffn_down` and fc2 `ffn_up`: a layer whose `ffn_down` reads
  the tower's width (what fc1 reads) is taken as swapped back, as llama.cpp's own loader does (clip.cpp);
- Gemma 3's projector norm (`mm.soft_emb_norm`, a Gemma RMSNorm scaling by 1 + w) is stored as 1 + w: 1 is
  taken off again (its SigLIP tower's LayerNorms are stored as they are); its `mm_input_projection_weight`, a
  plain [vision, text] matrix that clip.cpp transposes itself, is stored untransposed and read back as it is;
- quantized tensors (rare in projector files) are dequantized by gguf's own dequantization.
No q/k permutation is applied to any of these towers by the converters, so none is undone.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kettle.hub.gguf_header import TensorInfo, read_header
from kettle.hub.mmproj import MMPROJ_LINK, PROJECTOR_TYPE
from kettle.tensors.gguf_file import check_supported, raw_rows

# (the Hugging Face name after the family's tower prefix, as a pattern; llama.cpp's name(s) for it; how the stored
# parts become the tensor: "rows" stacks them as rows, "frames" as the two frames of a Conv3d kernel, "less_one"
# takes off the 1 the converter added to a Gemma norm). Of a name's rules, the first whose parts the file all has
# applies.
Rule = tuple[str, tuple[str, ...], str | None]

_VIT: tuple[Rule, ...] = (  # the CLIP and SigLIP encoders (LLaVA's, Idefics3's)
    (r"embeddings\.patch_embedding\.(weight|bias)", (r"v.patch_embd.\1",), None),
    (r"embeddings\.class_embedding", ("v.class_embd",), None),
    (r"embeddings\.position_embedding\.weight", ("v.position_embd.weight",), None),
    (r"pre_layrnorm\.(weight|bias)", (r"v.pre_ln.\1",), None),
    (r"post_layernorm\.(weight|bias)", (r"v.post_ln.\1",), None),
    (r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", (r"v.blk.\1.attn_\2.\3",), None),
    (r"encoder\.layers\.(\d+)\.self_attn\.out_proj\.(weight|bias)", (r"v.blk.\1.attn_out.\2",), None),
    (r"encoder\.layers\.(\d+)\.layer_norm([12])\.(weight|bias)", (r"v.blk.\1.ln\2.\3",), None),
    (r"encoder\.layers\.(\d+)\.mlp\.fc1\.(weight|bias)", (r"v.blk.\1.ffn_up.\2",), None),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.(weight|bias)", (r"v.blk.\1.ffn_down.\2",), None),
)
_LLAVA: tuple[Rule, ...] = (  # the two-layer projector: linear_1, GELU, linear_2 (mm.0 and mm.2)
    (r"multi_modal_projector\.linear_1\.(weight|bias)", (r"mm.0.\1",), None),
    (r"multi_modal_projector\.linear_2\.(weight|bias)", (r"mm.2.\1",), None),
)
_IDEFICS3: tuple[Rule, ...] = ((r"connector\.modality_projection\.proj\.weight", ("mm.model.fc.weight",), None),)
_GEMMA3: tuple[Rule, ...] = (
    (r"multi_modal_projector\.mm_soft_emb_norm\.weight", ("mm.soft_emb_norm.weight",), "less_one"),
    (r"multi_modal_projector\.mm_input_projection_weight", ("mm.input_projection.weight",), None),
)
_QWEN: tuple[Rule, ...] = (
    (r"patch_embed\.proj\.weight", ("v.patch_embd.weight", "v.patch_embd.weight.1"), "frames"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", tuple(rf"v.blk.\1.attn_{p}.\2" for p in "qkv"), "rows"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", (r"v.blk.\1.attn_qkv.\2",), None),  # a converter that kept it
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", (r"v.blk.\1.attn_out.\2",), None),
    (r"blocks\.(\d+)\.norm([12])\.(weight|bias)", (r"v.blk.\1.ln\2.\3",), None),
    (r"blocks\.(\d+)\.mlp\.(?:fc1|up_proj)\.(weight|bias)", (r"v.blk.\1.ffn_up.\2",), None),
    (r"blocks\.(\d+)\.mlp\.gate_proj\.(weight|bias)", (r"v.blk.\1.ffn_gate.\2",), None),
    (r"blocks\.(\d+)\.mlp\.(?:fc2|down_proj)\.(weight|bias)", (r"v.blk.\1.ffn_down.\2",), None),
    (r"merger\.ln_q\.(weight|bias)", (r"v.post_ln.\1",), None),
    (r"merger\.mlp\.([02])\.(weight|bias)", (r"mm.\1.\2",), None),
)
# projector type → the tower's prefix in the family's names, and its rules.
FAMILIES: dict[str, tuple[str, tuple[Rule, ...]]] = {
    "mlp": ("vision_tower.", _VIT),
    "idefics3": ("vision_model.", _VIT),
    "gemma3": ("vision_tower.", _VIT),
    "qwen2vl_merger": ("visual.", _QWEN),
    "qwen2.5vl_merger": ("visual.", _QWEN),
}
# Rules outside the tower's prefix (the projector's own module).
PROJECTOR_RULES: dict[str, tuple[Rule, ...]] = {"mlp": _LLAVA, "idefics3": _IDEFICS3, "gemma3": _GEMMA3}
_FFN = re.compile(r"v\.blk\.(\d+)\.ffn_(up|down)\.(weight|bias)")


def folder_mmproj(folder: Path) -> Path | None:
    """The projector file a prepared model folder reads its vision tower from, if it has one."""
    link = folder / MMPROJ_LINK
    return link if link.exists() else None


class MmprojTensors:
    """The vision tensors of one projector file by Hugging Face name: shapes and dense float32 values."""

    def __init__(self, path: Path) -> None:
        header = read_header(path)
        self.path = path
        self.kind = header.fields.get(PROJECTOR_TYPE) or header.fields.get("clip.vision.projector_type")
        if self.kind not in FAMILIES:
            raise ValueError(f"{path}: projector type {self.kind!r} has no tensor names here ({', '.join(FAMILIES)})")
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self._tensors = {tensor.name: tensor for tensor in header.tensors}
        self._prefix, tower = FAMILIES[self.kind]
        self._rules = [(re.compile(re.escape(self._prefix) + pattern), parts, join) for pattern, parts, join in tower]
        projector = PROJECTOR_RULES.get(self.kind, ())
        self._rules += [(re.compile(pattern), parts, join) for pattern, parts, join in projector]
        self._swapped = self._swapped_layers(int(header.fields.get("clip.vision.embedding_length") or 0))

    @property
    def names(self) -> list[str]:
        return sorted(self._tensors)

    def _swapped_layers(self, width: int) -> set[str]:
        """The layers whose fc1 and fc2 the older converter wrote as ffn_down and ffn_up (llama.cpp's test: the
        `ffn_down` reads the tower's width, as fc1 does)."""
        swapped = set()
        for name, tensor in self._tensors.items():
            found = _FFN.fullmatch(name)
            down = found is not None and found[2] == "down" and found[3] == "weight" and tensor.dims[0] == width
            if down and f"v.blk.{found[1]}.ffn_up.weight" in self._tensors:
                swapped.add(found[1])
        return swapped

    def parts(self, name: str) -> tuple[list[str], str | None] | None:
        """The file's tensors that make `name`, and how they join (None when the file has no such tensor)."""
        for pattern, templates, join in self._rules:
            found = pattern.fullmatch(name)
            if found is None:
                continue
            stored = [self._unswapped(found.expand(template)) for template in templates]
            if all(part in self._tensors for part in stored):
                return stored, join
        return None

    def _unswapped(self, stored: str) -> str:
        found = _FFN.fullmatch(stored)
        if found is None or found[1] not in self._swapped:
            return stored
        other = "down" if found[2] == "up" else "up"
        return f"v.blk.{found[1]}.ffn_{other}.{found[3]}"

    def has(self, name: str) -> bool:
        return self.parts(name) is not None

    def shape(self, name: str) -> list[int]:
        """`name`'s shape in Hugging Face's layout, from the header (nothing is read)."""
        found = self.parts(name)
        if found is None:
            raise KeyError(f"tensor {name!r} is not in {self.path}")
        stored, join = found
        shapes = [[int(d) for d in reversed(self._tensors[part].dims)] for part in stored]
        if join == "rows":
            return [sum(shape[0] for shape in shapes), *shapes[0][1:]]
        if join == "frames":
            return [*shapes[0][:2], len(shapes), *shapes[0][2:]]
        return shapes[0]

    def dense(self, name: str) -> torch.Tensor:
        """`name`'s values in float32, in Hugging Face's layout."""
        found = self.parts(name)
        if found is None:
            raise KeyError(f"tensor {name!r} is not in {self.path}")
        stored, join = found
        values = [self._values(self._tensors[part]) for part in stored]
        if join == "rows":
            return torch.cat(values)
        if join == "frames":  # two Conv2d kernels [out, in, P, P] → one Conv3d [out, in, 2, P, P]
            return torch.stack(values, dim=2)
        if join == "less_one":  # the family adds the 1 back (gemma_norm)
            return values[0] - 1.0
        return values[0]

    def _values(self, tensor: TensorInfo) -> torch.Tensor:
        from gguf.quants import dequantize

        check_supported(T(tensor.qtype), tensor.name)
        # A copy: the map is read-only, and a tensor over it would crash anything that writes in place.
        values = np.array(dequantize(raw_rows(self.map, tensor), T(tensor.qtype)), np.float32)
        return torch.from_numpy(values).reshape([int(d) for d in reversed(tensor.dims)])
