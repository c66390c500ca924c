"""Where LoRA adapters come from: `--lora-adapters` entries (TGI's syntax) and the folder each one is in.

Torch-free, so the launcher can name the adapters for the router while the shards load them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class AdapterError(ValueError):
    """An adapter that cannot serve (the message names the adapter, and the module where that applies)."""


@dataclass(frozen=True)
class AdapterSource:
    """One entry of `--lora-adapters`: the name requests use (`adapter_id`) and where the checkpoint is."""

    name: str
    location: str

    @classmethod
    def parse_list(cls, value: str | None) -> list[AdapterSource]:
        """`a=/path/a,org/b` → [a → /path/a, org/b → org/b]: a bare entry is a Hub id named by itself."""
        sources = []
        for item in filter(None, (part.strip() for part in (value or "").split(","))):
            name, _, location = item.partition("=")
            sources.append(cls(name.strip(), (location or name).strip()))
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise AdapterError(f"--lora-adapters names an adapter twice: {', '.join(names)}")
        return sources

    def folder(self) -> Path:
        """A local folder as it is; anything else is a Hub id, downloaded (adapter files only) into the cache."""
        path = Path(self.location).expanduser()
        if path.is_dir():
            return path
        from huggingface_hub import snapshot_download

        patterns = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
        try:
            return Path(snapshot_download(self.location, allow_patterns=patterns))
        except Exception as error:  # offline, unknown repo, no access: one line naming the adapter
            message = f"adapter `{self.name}`: {self.location} is not a folder and not on the Hub ({error})"
            raise AdapterError(message) from None
