"""Block hashes taken while DeepSpeed's writer writes, and checked on several threads."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from z3guard.checkpoint import digest


@pytest.mark.parametrize("legacy", [False, True])
def test_hashes_taken_while_writing_equal_those_read_back(tmp_path, monkeypatch, legacy):
    monkeypatch.setattr(digest, "BLOCK", 1 << 20)  # several blocks, and writes that span them
    monkeypatch.setattr(digest, "OVERLAP", 1 << 16)
    state = {"flat": torch.randn(700_000), "half": torch.randn(300_000).half(), "meta": [1, "x"]}
    with ThreadPoolExecutor(2) as pool:
        writer = digest.HashingWriter(tmp_path / "w.pt", pool)
        torch.save(state, writer, _use_new_zipfile_serialization=not legacy)
        writer.close()
        writer.synced()
        entry = writer.entry()
        loaded = torch.load(tmp_path / "w.pt", weights_only=False)
        assert torch.equal(loaded["flat"], state["flat"]) and loaded["meta"] == state["meta"]
        assert entry == digest.hash_files([tmp_path / "w.pt"], pool)[tmp_path / "w.pt"]
        assert len(entry["sha256_blocks"]) == -(-entry["size"] // (1 << 20)) > 1
        assert digest.mismatch(tmp_path / "w.pt", entry, pool) is None
        data = bytearray((tmp_path / "w.pt").read_bytes())
        data[(1 << 20) + 5] ^= 1
        (tmp_path / "w.pt").write_bytes(data)
        assert digest.mismatch(tmp_path / "w.pt", entry, pool).startswith("block 1 (bytes 1048576-2097151)")


def test_a_manifest_with_whole_file_hashes_still_verifies(tmp_path):
    import hashlib

    (tmp_path / "f").write_bytes(b"abc" * 1000)
    whole = {"size": 3000, "sha256": hashlib.sha256(b"abc" * 1000).hexdigest()}
    with ThreadPoolExecutor(1) as pool:
        assert digest.mismatch(tmp_path / "f", whole, pool) is None
        (tmp_path / "f").write_bytes(b"abd" * 1000)
        assert "the manifest says" in digest.mismatch(tmp_path / "f", whole, pool)


def test_an_early_write_back_failure_is_raised_by_synced(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "BLOCK", 1 << 16)
    monkeypatch.setattr(digest, "OVERLAP", 1 << 10)
    calls = []

    def fdatasync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(digest.os, "fdatasync", fdatasync)
    with ThreadPoolExecutor(2) as pool:
        writer = digest.HashingWriter(tmp_path / "w.pt", pool)
        writer.write(bytes(1 << 18))  # four blocks: the first one's write-back fails
        writer.close()
        with pytest.raises(OSError, match="Input/output error"):
            writer.synced()
    assert len(calls) >= 2 and (tmp_path / "w.pt").stat().st_size == 1 << 18


def test_without_sync_the_writer_leaves_the_bytes_to_the_page_cache(tmp_path, monkeypatch):
    """A save published before it is on disk writes as stock's `torch.save` does: no fdatasync beside the
    writes (it would slow them to the disk's rate); the hashes are the same."""
    monkeypatch.setattr(digest, "BLOCK", 1 << 16)
    monkeypatch.setattr(digest, "OVERLAP", 1 << 10)
    calls = []
    monkeypatch.setattr(digest.os, "fdatasync", calls.append)
    with ThreadPoolExecutor(2) as pool:
        writer = digest.HashingWriter(tmp_path / "w.pt", pool, sync=False)
        writer.write(bytes(range(256)) * 1024)  # four blocks
        writer.close()
        writer.written()
        writer.synced()
        assert writer.entry() == digest.hash_files([tmp_path / "w.pt"], pool)[tmp_path / "w.pt"]
    assert calls == [] and (tmp_path / "w.pt").stat().st_size == 1 << 18
