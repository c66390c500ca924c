"""The tokenizer facts the shard needs per token: texts, special flags, EOS ids, final decoding.

The shard never encodes (the router sends token ids); it decodes, names the special tokens and hands the
tokenizer to llguidance. A folder whose tokenizer transformers would load from tokenizer.json unchanged is read
with the `tokenizers` library alone (`FileTokenizer`): transformers' AutoTokenizer would import transformers
into the shard, ~100 MB resident and over a second of start-up (it loads torch._dynamo and torch._inductor on
the way), and keep a second Python-side copy of the vocabulary. Any other folder (another tokenizer class, a
special token tokenizer.json does not declare, remote code) still goes through AutoTokenizer.

The router reads the same file with a looser test (kettle/router/tokenizer.py: only that the post-processor adds
the BOS/EOS the config asks for), because it only encodes; the shard also names the special tokens and decodes
with them, so it needs everything transformers would change about them to be absent.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from kettle.shard.detokenize import decoder_of, special_token_ids

# tokenizer_config.json classes for which transformers uses tokenizer.json as it is (TokenizersBackend, and its
# older name): the model-specific classes rebuild the Rust tokenizer from the vocabulary and their own rules.
PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# The special tokens transformers names (`SPECIAL_TOKENS_ATTRIBUTES`), in the order of its `all_special_ids`.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# Above this vocabulary size transformers may rewrite the pre-tokenizer of Mistral tokenizers.
_MISTRAL_CHECK_VOCAB = 100_000


class FileTokenizer:
    """A folder's tokenizer.json through the `tokenizers` library, with what the shard reads of a transformers
    tokenizer: `backend_tokenizer`, `decode`, `len()`, `eos_token_id`, `all_special_ids`, `added_tokens_decoder`."""

    def __init__(self, backend: Any, special_tokens: dict[str, str], extra_special_tokens: list[str]) -> None:
        self.backend_tokenizer = backend
        self.added_tokens_decoder = backend.get_added_tokens_decoder()
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos is not None else None
        names = [special_tokens[key] for key in NAMED_SPECIAL_TOKENS if key in special_tokens]
        self.all_special_ids = [backend.token_to_id(token) for token in dict.fromkeys(names + extra_special_tokens)]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        # transformers' decode of a tokenizers-backed tokenizer is this call, then an optional clean-up that the
        # shard never asks for (it cannot be done incrementally).
        if clean_up_tokenization_spaces:
            raise ValueError("FileTokenizer does not clean up tokenization spaces")
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_file_tokenizer(model_path: Path) -> FileTokenizer | None:
    """The folder's tokenizer read with the `tokenizers` library, when transformers would build the very same
    one from tokenizer.json (module docstring); None when it would not, or might not."""
    file, config_file = model_path / "tokenizer.json", model_path / "tokenizer_config.json"
    if not file.is_file() or not config_file.is_file():
        return None
    # The legacy files transformers merges in: their special and added tokens would change the tokenizer.
    if any((model_path / name).exists() for name in LEGACY_FILES):
        return None
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in PLAIN_CLASSES or "auto_map" in config:
        return None
    # transformers' own flags that change the Rust tokenizer: splitting special tokens, or a post-processor
    # rebuilt from add_bos_token / add_eos_token.
    if config.get("split_special_tokens") or "add_bos_token" in config or "add_eos_token" in config:
        return None
    special_tokens: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, str | dict):
            if key not in NAMED_SPECIAL_TOKENS:
                return None  # a model-specific special token (image_token...): transformers names it special
            special_tokens[key] = _content(value)
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if not isinstance(extra, list):
        return None
    extra_special_tokens = [_content(token) for token in extra]
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(file))
    if backend.post_processor is None:
        return None  # transformers builds one
    if backend.get_vocab_size() > _MISTRAL_CHECK_VOCAB and backend.pre_tokenizer is not None:
        return None
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    # transformers adds every special token the file lacks (or has as a plain token) to the Rust tokenizer.
    for token in [*special_tokens.values(), *extra_special_tokens]:
        if token not in added or not added[token].special:
            return None
    for index, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.id_to_token(int(index)) != token.get("content") or not _same_added_token(added, token):
            return None
    return FileTokenizer(backend, special_tokens, extra_special_tokens)


def _content(token: str | dict) -> str:
    return token["content"] if isinstance(token, dict) else token


def _same_added_token(added: dict[str, Any], token: dict) -> bool:
    have = added.get(token.get("content"))
    keys = ("special", "lstrip", "rstrip", "normalized", "single_word")
    return have is not None and all(getattr(have, key) == token[key] for key in keys if key in token)


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer: a `FileTokenizer` where that is exactly what transformers would load, else
    transformers' AutoTokenizer (imported only then)."""
    tokenizer = load_file_tokenizer(Path(model_path))
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)


class Vocab:
    """Wraps the model's tokenizer with the cheap per-token look-ups the step loop makes."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = special_token_ids(tokenizer)
        self._decode_one = decoder_of(tokenizer)
        # Token texts are looked up for every generated and top token: cache them per instance.
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def load(cls, model_path: str, trust_remote_code: bool = False) -> Vocab:
        """Loads the tokenizer of a model folder and its EOS ids (generation_config.json, config, tokenizer)."""
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        return cls(tokenizer, frozenset(eos_token_ids(Path(model_path), tokenizer)))

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def _token_text(self, token_id: int) -> str:
        return self._decode_one([token_id])


def eos_token_ids(model_path: Path, tokenizer: Any) -> set[int]:
    """Every EOS id the model declares: generation_config.json lists all of them (e.g. Llama 3's)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = model_path / name
        if file.exists():
            ids |= _as_set(json.loads(file.read_text()).get("eos_token_id"))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}
