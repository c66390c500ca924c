"""The tokenizer facts the shard needs per token: texts, special flags, EOS ids, final decoding."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kettle.shard.detokenize import decoder_of, special_token_ids


class Vocab:
    """Wraps the model's tokenizer with the cheap per-token look-ups the step loop makes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = special_token_ids(tokenizer)
        self._decode_one = decoder_of(tokenizer)
        # Token texts are looked up for every generated and top token: cache them per instance.
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def load(cls, model_path: str, trust_remote_code: bool = False) -> Vocab:
        """Loads the tokenizer of a model folder and its EOS ids (generation_config.json, config, tokenizer)."""
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        return cls(tokenizer, frozenset(eos_token_ids(Path(model_path), tokenizer)))

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def _token_text(self, token_id: int) -> str:
        return self._decode_one([token_id])


def eos_token_ids(model_path: Path, tokenizer: PreTrainedTokenizerBase) -> set[int]:
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
