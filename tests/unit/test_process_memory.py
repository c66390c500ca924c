"""The start-up line of each process's resident memory, and a CPU shard's split of it: KV cache and the rest."""

from __future__ import annotations

import logging
import re

from kettle.process_memory import format_bytes, log_resident_memory, resident_bytes


def logged(caplog, **kwargs) -> logging.LogRecord:
    with caplog.at_level(logging.INFO, logger="memory-test"):
        log_resident_memory(logging.getLogger("memory-test"), "shard-0", **kwargs)
    (record,) = caplog.records
    return record


def test_a_process_logs_its_resident_memory_in_one_line(caplog):
    record = logged(caplog)
    assert re.fullmatch(r"Resident memory of shard-0: [0-9.]+ (MiB|GiB)", record.getMessage())
    assert record.fields["process"] == "shard-0"
    assert abs(record.fields["resident_memory_bytes"] - resident_bytes()) < 64 * 2**20
    assert "kv_cache_bytes" not in record.fields


def test_a_cpu_shard_splits_its_memory_into_the_kv_cache_and_the_rest(caplog):
    kv = 8 * 2**20
    record = logged(caplog, kv_cache_bytes=kv)
    total = record.fields["resident_memory_bytes"]
    assert record.fields["kv_cache_bytes"] == kv
    assert record.getMessage() == (
        f"Resident memory of shard-0: {format_bytes(total)} (KV cache 8.0 MiB, the rest {format_bytes(total - kv)})"
    )
