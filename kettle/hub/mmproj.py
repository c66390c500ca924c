"""A vision-language GGUF's projector file (`mmproj`), as llama.cpp serves it: found beside the language model's
GGUF or named by `--mmproj`, and checked to be a projector Kettle serves natively.

llama.cpp ships a vision-language model as two files: the language model's GGUF and `mmproj-*.gguf`, whose
architecture is `clip`, holding the vision encoder (`v.*`) and the projector (`mm.*`), with
`clip.projector_type` naming the family. Each type Kettle serves maps to the native family that runs it
(`PROJECTORS`) and to the language architectures that family reads; the folder prepared from the pair is written
by kettle/hub/mmproj_config.py and its vision tensors read by kettle/tensors/mmproj_file.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kettle.hub.types import PreparationError

log = logging.getLogger(__name__)

MMPROJ_LINK = "mmproj.gguf"  # the name under which a prepared folder points at its projector file
PROJECTOR_TYPE = "clip.projector_type"


@dataclass(frozen=True)
class Projector:
    """A projector type Kettle serves: the `model_type` of the family that runs it and the language GGUF
    architectures that family reads."""

    model_type: str
    languages: tuple[str, ...]


# llama.cpp's `clip.projector_type` → the native family (its name in clip-impl.h's PROJECTOR_TYPE_NAMES).
PROJECTORS: dict[str, Projector] = {
    "mlp": Projector("llava", ("llama",)),
    "idefics3": Projector("idefics3", ("llama",)),
    "gemma3": Projector("gemma3", ("gemma3",)),
    "qwen2vl_merger": Projector("qwen2_vl", ("qwen2vl", "qwen2")),
    "qwen2.5vl_merger": Projector("qwen2_5_vl", ("qwen2vl", "qwen2")),
}


def is_mmproj(name: str) -> bool:
    """Whether a file name is a projector's, by llama.cpp's naming (`mmproj-*.gguf`, `mmproj.gguf`)."""
    base = PurePosixPath(name).name.lower()
    return base.startswith("mmproj") and base.endswith(".gguf")


def choose(names: list[str], beside: str) -> str | None:
    """The projector among `names` (paths in a folder or repository) that goes with the model file `beside`: one in
    the same folder; of several, the float16 one (what llama.cpp's repositories publish first; a quantized projector
    loses more than it saves, the tower being small), else the first by name."""
    folder = PurePosixPath(beside).parent
    candidates = sorted(name for name in names if is_mmproj(name) and PurePosixPath(name).parent == folder)
    if len(candidates) > 1:
        for tag in ("f16", "bf16", "f32"):
            tagged = [name for name in candidates if tag in PurePosixPath(name).name.lower().replace("-", "_")]
            if tagged:
                return tagged[0]
    return candidates[0] if candidates else None


def beside(gguf: Path) -> Path | None:
    """The projector file in the folder of the model file `gguf` (None when there is none)."""
    files = [path.name for path in gguf.parent.glob("*.gguf") if path.is_file() and path != gguf]
    name = choose(files, gguf.name)
    return None if name is None else gguf.parent / name


def projector_type(mmproj: Path) -> str:
    """The file's `clip.projector_type`; a `PreparationError` naming the file when it is no projector."""
    from kettle.hub.gguf_header import read_header

    try:
        fields = read_header(mmproj).fields
    except (ValueError, OSError) as error:
        raise PreparationError(f"Cannot read the projector file {mmproj}: {error}") from error
    kind = fields.get(PROJECTOR_TYPE) or fields.get("clip.vision.projector_type")
    if fields.get("general.architecture") != "clip" or not isinstance(kind, str):
        raise PreparationError(
            f"{mmproj} is not a vision projector file (llama.cpp's mmproj: architecture 'clip' with "
            f"{PROJECTOR_TYPE}); pass the mmproj-*.gguf published beside the model"
        )
    return kind


def supported(mmproj: Path, language: str) -> Projector:
    """The family serving `mmproj` beside a language model of GGUF architecture `language`; a `PreparationError`
    naming the projector type and the supported ones otherwise."""
    kind = projector_type(mmproj)
    projector = PROJECTORS.get(kind)
    if projector is None:
        served = ", ".join(f"{name} ({p.model_type})" for name, p in PROJECTORS.items())
        raise PreparationError(
            f"Cannot serve images with {mmproj}: its projector type {kind!r} is not one Kettle serves natively "
            f"(supported: {served}); pass another --mmproj, or the model without one"
        )
    if language not in projector.languages:
        raise PreparationError(
            f"Cannot serve images with {mmproj}: a {kind!r} projector goes with a {' or '.join(projector.languages)} "
            f"language model, and the model is {language!r}; pass the mmproj published beside the model"
        )
    return projector


def usable_beside(mmproj: Path, language: str) -> Path | None:
    """A projector found beside the model (not asked for by `--mmproj`): itself when Kettle serves it; otherwise a
    warning, and None, so the model still serves its text as it did without the file."""
    try:
        supported(mmproj, language)
    except PreparationError as error:
        log.warning("%s (found beside the model; serving text only)", error)
        return None
    return mmproj
