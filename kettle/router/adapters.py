"""`adapter_id` on generate requests: it must name a loaded LoRA adapter.

An unknown adapter answered by the base model would look like the adapter's answer, so it is refused with a 422
that lists what is loaded instead (the shards load `--lora-adapters` at start, and the launcher hands their names
to the router). The base model is asked for by leaving `adapter_id` out.
"""

from __future__ import annotations

from collections.abc import Sequence

from kettle.router.errors import ValidationError
from kettle.router.schemas import GenerateParameters


def check_adapter(parameters: GenerateParameters | None, loaded: Sequence[str]) -> None:
    """422 `validation` when `adapter_id` is set and not one of `loaded`."""
    adapter_id = parameters.adapter_id if parameters is not None else None
    if not adapter_id or adapter_id in loaded:
        return
    names = ", ".join(f"`{name}`" for name in loaded) or "none"
    raise ValidationError(f"adapter `{adapter_id}` is not loaded (loaded adapters: {names})")
