"""Environment variables TGI's launcher reads that are not the UPPER_SNAKE name of a flag.

- `PREFIX_CACHING=0` (or false) turns prefix caching off, as `--disable-prefix-caching` does.
- `HF_API_TOKEN` is TGI's older name for the Hub token: it becomes `HF_TOKEN` for the download and every child,
  taking precedence as it does in TGI.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FALSE_WORDS = {"0", "false", "no", "off"}


def prefix_caching_disabled(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether `PREFIX_CACHING` says off."""
    return environ.get("PREFIX_CACHING", "").strip().lower() in FALSE_WORDS


def apply_token_alias(environ: MutableMapping[str, str] = os.environ) -> None:
    """Copies `HF_API_TOKEN` to `HF_TOKEN`, which huggingface_hub reads (in this process and, inherited, in
    the children)."""
    token = environ.get("HF_API_TOKEN")
    if token:
        environ["HF_TOKEN"] = token
