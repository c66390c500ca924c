"""Servers with injected faults: the environment that loads `tests/fault_site/sitecustomize.py` into them."""

from __future__ import annotations

import os
from pathlib import Path

FAULT_SITE = Path(__file__).parent / "fault_site"


def fault_env() -> dict[str, str]:
    """Environment for `KettleServer(env=...)`: a prompt with `FAULT:<stage>` makes that stage raise for it."""
    path = os.pathsep.join(p for p in (str(FAULT_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KETTLE_TEST_FAULTS": "1"}


def fault_prompt(stage: str, text: str = "Hello") -> str:
    return f"{text} FAULT:{stage}"
