"""What the launcher process holds after preparing the bundled model with an empty cache: neither transformers nor
torch (the preparation imports them in its own child process), and at most 60 MiB resident; and how it stops
when told to in the middle of that preparation.

The launcher runs as `launch()` in a fresh interpreter, up to the point where it would start the shards: the
supervisor is replaced by one that reports the process's state, and neither the CPU kernels are built nor the
shards started beside the preparation (both are subprocesses anyway; skipping them keeps the test to the
preparation's ~7 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

LAUNCHER = """
import json, sys, threading
from kettle.launcher import main
from kettle.launcher.config import LauncherConfig

class Supervisor:
    def __init__(self, shards, router, **_):
        self.model_path = shards[0].argv[shards[0].argv.index("serve") + 1]

    def run(self):
        rss_kib = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
        heavy = [name for name in ("transformers", "torch", "tokenizers") if name in sys.modules]
        print(json.dumps({"heavy": heavy, "rss_mib": rss_kib / 1024, "model_path": self.model_path}))
        return 0

def no_kernels():
    thread = threading.Thread(target=lambda: None)
    thread.start()
    return thread

main.Supervisor, main._build_kernels_meanwhile = Supervisor, no_kernels
main._start_early = lambda config, early: None  # no shard or router beside the preparation (tests/e2e has those)
sys.exit(main.launch(LauncherConfig(**json.loads(sys.argv[1]))))
"""


def start_launcher(cache, flags: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "KETTLE_CACHE": str(cache)}
    command = [sys.executable, "-c", LAUNCHER, json.dumps(flags or {})]
    # SIGINT as a terminal delivers it: a suite run in the background by a non-interactive shell ignores SIGINT,
    # and Python leaves an inherited "ignore" in place (the SIGINT case would then test nothing but that).
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def launch_facts(cache, flags: dict | None = None) -> tuple[dict, str]:
    """The launcher's report (heavy modules, resident MiB, the model folder) and its log."""
    launcher = start_launcher(cache, flags)
    stdout, stderr = launcher.communicate(timeout=280)
    assert launcher.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def test_a_first_start_leaves_the_launcher_without_transformers_and_under_60_mib(tmp_path):
    facts, stderr = launch_facts(tmp_path / "cache")
    assert "Converting SmolLM2-135M-Instruct" in stderr  # a first start: the child prepared the folder
    assert facts["heavy"] == []
    assert facts["rss_mib"] <= 60
    assert os.path.isfile(os.path.join(facts["model_path"], "tokenizer.json"))
    # --quantize makes the launcher ask how many GPUs the shards will see (a CUDA scheme or the CPU's): torch
    # answers that in a child too. A later start, over the folder the first one prepared.
    facts, stderr = launch_facts(tmp_path / "cache", {"quantize": "int4"})
    assert "Converting" not in stderr
    assert facts["heavy"] == [] and facts["rss_mib"] <= 60


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stopping_the_launcher_mid_preparation_stops_the_child_and_leaves_no_temporary_files(tmp_path, signum):
    launcher = start_launcher(tmp_path / "cache")
    seen = []
    for line in launcher.stderr:  # the child's log lines come through the launcher's stderr
        seen.append(line)
        if "Converting" in line:
            break
    launcher.send_signal(signum)
    _, rest = launcher.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert launcher.returncode == 130, stderr
    assert "Stopped while preparing the model" in stderr and "Traceback" not in stderr
    (child,) = re.findall(r"Started model preparation \(pid (\d+)\)", stderr)
    assert not os.path.exists(f"/proc/{child}")
    left = [path.name for path in (tmp_path / "cache" / "models").iterdir()]
    assert left == [], stderr  # the log says whether the child stopped on its own or was killed
