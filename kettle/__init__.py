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
    """A child's PYTHONPATH: the folder this package was imported from, then what the parent's had. Not an installed
    package's site-packages, which the child finds anyway: on PYTHONPATH it would come before the standard library,
    and a stale backport installed there (`typing`, say) would then replace the standard module."""
    import site

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = {os.path.abspath(path) for path in [*site.getsitepackages(), site.getusersitepackages()]}
    return os.pathsep.join([*([here] if here not in installed else []), *([inherited] if inherited else [])])
