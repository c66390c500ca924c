"""`--rope-scaling` / `--rope-factor`: the launcher's RoPE override, applied to the model config at load.

As in TGI, the launcher hands the override to the shards as `ROPE_SCALING` (linear or dynamic) and `ROPE_FACTOR`
environment variables, and the shard rewrites the config's RoPE settings before any model is built from it, so
every RoPE family (and the transformers fallback) sees the same scaling. Models without RoPE ignore it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)


def apply_rope_override(config, environ: Mapping[str, str] = os.environ) -> bool:
    """Rewrites `config`'s RoPE parameters from `ROPE_SCALING` / `ROPE_FACTOR`; False when neither is set.

    transformers 5 keeps RoPE in `rope_parameters` (with `rope_theta` inside), 4.x in `rope_scaling` beside
    `rope_theta`: whichever the config has is replaced, keeping the base frequency.
    """
    scaling, factor = environ.get("ROPE_SCALING"), environ.get("ROPE_FACTOR")
    if not scaling and not factor:
        return False
    current = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(current.get("full_attention"), dict):
        # Settings per layer type (Gemma 3): the scaling is the global layers', as transformers reads `rope_scaling`.
        target = dict(current)
        target["full_attention"] = _overridden(current["full_attention"], scaling, factor)
        config.rope_parameters = target
        log.info("RoPE scaling of the full-attention layers overridden: %s", target["full_attention"])
        return True
    params = _overridden(current, scaling, factor)
    if hasattr(config, "rope_parameters"):
        params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        config.rope_parameters = params
    else:
        config.rope_scaling = params
    log.info("RoPE scaling overridden: %s with factor %s", params["rope_type"], params["factor"])
    return True


def _overridden(current, scaling: str | None, factor: str | None) -> dict:
    """RoPE settings with the override's type and factor, keeping the base frequency and the rotary fraction."""
    params = {key: value for key, value in dict(current).items() if key in ("rope_theta", "partial_rotary_factor")}
    params.update(rope_type=scaling or "linear", factor=float(factor or 1.0))
    return params
