"""scripts/gpu-check.sh, the one command a lent GPU machine runs: it must parse, and every test file it names must
exist (a renamed test would otherwise cost a scarce device run to find out)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "scripts" / "gpu-check.sh", ROOT / "scripts" / "gpu-deps.sh"]


def test_the_scripts_parse():
    for script in SCRIPTS:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script


def test_every_test_file_the_device_run_names_exists():
    text = SCRIPTS[0].read_text()
    named = re.findall(r"tests/[\w/]+\.py", text)
    assert len(named) >= 10
    assert [path for path in named if not (ROOT / path).is_file()] == []
