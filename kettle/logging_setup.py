"""Logging for every Kettle process: readable lines by default, JSON lines with `--json-output`.

The launcher, the router and each shard call `setup_logging` once at start, so all three write the same
format and a log collector can parse their interleaved output.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LEVEL_ENV = "LOG_LEVEL"
DEFAULT_LEVEL = "INFO"
# Whether setup_logging chose JSON lines: progress reporting (kettle/progress.py) draws no bars then.
_json_output = False


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`2025-01-01T12:00:00.000Z  INFO kettle.launcher: message` (UTC, like TGI's text logs)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname:>5} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target (the logger name), message, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": _timestamp(record),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)  # structured values a call passed as extra={"fields": {...}}
        if isinstance(fields, dict):
            entry["fields"] = fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def resolve_level(level: str | None = None) -> int:
    """The numeric level for `level`, else `$LOG_LEVEL`, else INFO; an unknown name falls back to INFO."""
    name = (level or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL).upper()
    value = logging.getLevelName(name)
    return value if isinstance(value, int) else logging.INFO


def json_output_enabled() -> bool:
    """Whether this process logs JSON lines (`--json-output`)."""
    return _json_output


def setup_logging(json_output: bool = False, level: str | None = None) -> None:
    """Sends all logging to stderr in the chosen format. Safe to call again: it replaces the handler."""
    global _json_output
    _json_output = json_output
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(resolve_level(level))
    # Python warnings (e.g. from transformers) become log records too, so JSON output stays JSON.
    logging.captureWarnings(True)
    # Libraries that log every HTTP request or file lookup at INFO would drown Kettle's own lines.
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
