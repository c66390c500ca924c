"""Kettle: a text-generation inference server with TGI's API."""

from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def python_command(module: str) -> list[str]:
    """`python -m module` for a child process that runs this very copy of Kettle (with `child_pythonpath`): this
    interpreter, and `-P`, so that the child's working directory does not come first on its sys.path. `-m` alone
    puts it there, and a `kettle` folder in it (another checkout, an older tree) would run in the child instead."""
    return [sys.executable, "-P", "-m", module]


def child_pythonpath(inherited: str | None) -> str:
    """A child's PYTHONPATH: the folder this package was imported from, then what the parent's had."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([here, *([inherited] if inherited else [])])
