"""Seconds from `kettle launch` to a healthy server, first with an empty Kettle cache, then again with it filled.

    PYTHONPATH=. .venv/bin/python bench/startup_time.py [--runs 2] [-- LAUNCH FLAGS...]

The first start prepares the model folder from the GGUF into the (temporary) cache; the later ones reuse it. The
C kernels come from the install (scripts/install.sh builds them into the environment); with
KETTLE_INSTALLED_KERNELS=0 the first start builds them into the cache as well, as a bare `pip install` would.
Each run prints its time, the launcher's log lines that say where the time went, and the resident memory each
process logged.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kettle.bench.process import free_port, wait_healthy

# The log lines that say where the start-up time went.
TELLING = re.compile(
    r"Convert|Model .* ready|shard\(s\) ready|Warming up|warmed up|Loading weights|Resident memory|Serving"
)


def start_once(cache: str, flags: list[str]) -> tuple[float, list[str]]:
    """Starts a server with KETTLE_CACHE=`cache`; returns the seconds until /health said 200 and the telling lines."""
    port = free_port()
    sockets = tempfile.mkdtemp(prefix="kettle-startup-")
    argv = [sys.executable, "-m", "kettle.cli", "launch", "--port", str(port), "--hostname", "127.0.0.1"]
    argv += ["--shard-uds-path", os.path.join(sockets, "shard"), "--prometheus-port", "0", *flags]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        started = time.monotonic()
        env = {**os.environ, "KETTLE_CACHE": cache}
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            if not wait_healthy(url, process, "launcher", lambda: Path(log.name).read_text(), 900, poll=0.1):
                raise TimeoutError("not healthy within 900 s")
            seconds = time.monotonic() - started
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
        lines = [line for line in Path(log.name).read_text().splitlines() if TELLING.search(line)]
    return seconds, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="starts in all: the first with an empty cache")
    parser.add_argument("flags", nargs="*", help="flags for `kettle launch` (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kettle-cache-") as cache:
        for run in range(args.runs):
            seconds, lines = start_once(cache, args.flags)
            print(f"{'empty cache' if run == 0 else 'cache filled'}: healthy after {seconds:.1f} s")
            for line in lines:
                print("   ", line)


if __name__ == "__main__":
    main()
