"""How the model's preparation process takes a stop (kettle/hub/preparation_process.py): as KeyboardInterrupt, so a
conversion removes its temporary folder, but never in the middle of torch's first import, where the exception can
abort the process from C++ (pybind11) and leave the folder behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

CHILD = """
import json, os, signal, sys, time
from kettle.hub import preparation_process

preparation_process.set_up()
signum = int(sys.argv[1])


class StopInsideTorch:
    # The stop lands while torch's own code runs: as it imports torch.version, before it loads torch._C.
    def find_spec(self, name, path=None, target=None):
        if name == "torch.version":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signum)
        return None


sys.meta_path.insert(0, StopInsideTorch())
facts = {}
try:
    import torch
except KeyboardInterrupt:
    facts["imported when stopped"] = [name for name in ("torch._C", "torch.nn") if name in sys.modules]
started = time.monotonic()
try:
    os.kill(os.getpid(), signum)
    time.sleep(10)
except KeyboardInterrupt:
    facts["later stop after s"] = time.monotonic() - started
print(json.dumps(facts))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_torchs_import_waits_for_it_and_a_later_one_comes_at_once(signum):
    done = subprocess.run([sys.executable, "-c", CHILD, str(int(signum))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["imported when stopped"] == ["torch._C", "torch.nn"]  # held until torch's import was done
    assert facts["later stop after s"] < 5  # outside the import, raised at once
