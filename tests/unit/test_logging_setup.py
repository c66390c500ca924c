"""Logging setup: readable lines, JSON lines, and the level from LOG_LEVEL."""

from __future__ import annotations

import json
import logging

import pytest

from kettle.logging_setup import resolve_level, setup_logging


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_output_is_one_object_per_line(capsys):
    setup_logging(json_output=True)
    logging.getLogger("kettle.test").warning("hello %s", "world")
    entry = json.loads(capsys.readouterr().err.strip())
    assert entry["level"] == "WARNING"
    assert entry["target"] == "kettle.test"
    assert entry["message"] == "hello world"
    assert entry["timestamp"].endswith("Z")


def test_text_output_names_level_and_logger(capsys):
    setup_logging()
    logging.getLogger("kettle.test").info("ready")
    line = capsys.readouterr().err.strip()
    assert line.endswith("INFO kettle.test: ready")


def test_level_comes_from_log_level(monkeypatch):
    monkeypatch.setenv("LOG_LEVEL", "debug")
    assert resolve_level() == logging.DEBUG
    monkeypatch.setenv("LOG_LEVEL", "nonsense")
    assert resolve_level() == logging.INFO
    assert resolve_level("error") == logging.ERROR


def test_calling_twice_keeps_one_handler():
    setup_logging()
    setup_logging(json_output=True)
    assert len(logging.getLogger().handlers) == 1
