"""Progress at start-up: bars on a terminal, a log line every tenth elsewhere (and as JSON fields with
--json-output), nothing for what ends within the quiet time; weight loading counts distinct tensors; downloads
keep huggingface_hub's bars on a terminal and log instead of them elsewhere."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch

from kettle import progress
from kettle.logging_setup import setup_logging
from kettle.progress import LoggedProgress, progress_bar


@pytest.fixture
def no_quiet_time(monkeypatch):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)


@pytest.fixture(autouse=True)
def text_logs():
    yield
    setup_logging(False)  # the JSON test switches it; later tests expect the default


def _lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "kettle.progress"]


def test_a_line_every_tenth_then_done_when_closed_short_of_the_total(no_quiet_time, caplog):
    caplog.set_level(logging.INFO)
    with LoggedProgress(total=25, desc="Loading weights", unit="tensor") as bar:
        for _ in range(24):
            bar.update()
    lines = _lines(caplog)
    assert lines[0] == "Loading weights: 10% (3 of 25 tensors)" and len(lines) == 10
    assert lines[-1] == "Loading weights: done (24 of 25 tensors)"


def test_bytes_read_as_sizes_and_a_total_learnt_late_is_fine(no_quiet_time, caplog):
    caplog.set_level(logging.INFO)
    bar = LoggedProgress(total=0, desc="Downloading bytes", unit="B", unit_scale=True, bar_format="{desc}")
    bar.update(2**20)  # no total yet: nothing to say
    bar.total = 4 * 2**30
    bar.update(2**30)
    bar.close()
    assert _lines(caplog) == ["Downloading bytes: 20% (1.00GB of 4.00GB)", "Downloading bytes: done (1.00GB of 4.00GB)"]


def test_nothing_is_logged_within_the_quiet_time(caplog):
    caplog.set_level(logging.INFO)
    with LoggedProgress(total=3, desc="Fetching 3 files", unit="file") as bar:
        bar.update(3)  # a cached download: done at once
    assert _lines(caplog) == []


def test_json_output_gets_log_lines_with_fields_and_never_a_bar(no_quiet_time, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    setup_logging(False)
    assert progress.bars_shown()  # a terminal with text logs: tqdm bars
    setup_logging(True)
    assert not progress.bars_shown()
    bar = progress_bar(10, "Loading weights", "tensor")
    assert isinstance(bar, LoggedProgress)
    bar.update(5)
    bar.close()
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert records[0]["message"] == "Loading weights: 50% (5 of 10 tensors)"
    assert records[0]["fields"] == {"task": "Loading weights", "percent": 50, "done": 5, "total": 10, "unit": "tensor"}


def test_a_disabled_bar_shows_nothing(no_quiet_time, caplog):
    caplog.set_level(logging.INFO)
    with progress_bar(4, "Loading weights", "tensor", enabled=False) as bar:
        bar.update(4)
    assert _lines(caplog) == []


def test_loading_weights_counts_each_tensor_once(tiny_llama_path, no_quiet_time, caplog):
    from kettle.tensors.weights import Weights

    caplog.set_level(logging.INFO)
    with Weights(tiny_llama_path, torch.float32, "cpu") as weights:
        names = weights.names
        weights.get(names[0])
        weights.get_slice(names[0], 0, 0, 1)  # the same tensor again: not counted twice
        for name in names[1:]:
            weights.get(name)
    lines = _lines(caplog)
    assert lines[-1] == f"Loading weights: 100% ({len(names)} of {len(names)} tensors)"
    assert len(lines) == 10


@pytest.mark.parametrize("terminal", [True, False])
def test_downloads_keep_the_hub_bars_on_a_terminal_and_log_elsewhere(terminal, monkeypatch, tmp_path):
    import huggingface_hub

    from kettle.hub import download

    seen = {}

    def fake_snapshot_download(model_id, **kwargs):
        seen.update(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(download, "bars_shown", lambda: terminal)
    download.download_files("org/x-GGUF", None, None, ["x.Q4_K_M.gguf"])
    assert seen["tqdm_class"] is (None if terminal else LoggedProgress)
    assert seen["allow_patterns"][-1] == "x.Q4_K_M.gguf"
    from huggingface_hub.utils import are_progress_bars_disabled

    assert not are_progress_bars_disabled()  # nothing in Kettle turns huggingface_hub's bars off


def test_projections_a_quantization_scheme_loads_count_too(tiny_llama_path, no_quiet_time, caplog):
    from torch import nn

    from kettle.tensors.weights import Weights

    caplog.set_level(logging.INFO)

    class FileReadingScheme:
        """Reads the file itself (as GGUF blocks are read) and never calls `get`."""

        def load_linear(self, weights, prefixes):
            return nn.Identity()

        def quantize_tensor(self, weight, bias):
            return None

    with Weights(tiny_llama_path, torch.float32, "cpu", quantize=FileReadingScheme()) as weights:
        projections = [name for name in weights.names if name.endswith("proj.weight")]
        weights.quantize.load_linear(weights, [name.removesuffix(".weight") for name in projections])
        for name in set(weights.names) - set(projections):
            weights.get(name)
    assert _lines(caplog)[-1].startswith("Loading weights: 100% (")
