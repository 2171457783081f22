"""Local writes: a data object's parts land back to back, byte for byte, however many parts it has and however
few bytes each writev(2) call writes (the kernel may write fewer than asked)."""

from __future__ import annotations

import os

import numpy as np

from harvest.storage import Storage, local


def many_parts() -> list:
    """A header, empty parts, thousands of arrays of 0-5000 bytes (more than IOV_MAX), a memoryview."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, n, np.uint8) for n in rng.integers(0, 5000, 2500)]
    return [b"header", b"", *arrays, memoryview(b"tail")]


def test_parts_land_back_to_back(tmp_path):
    parts = many_parts()
    Storage(str(tmp_path)).write_bytes("shard.bin", parts)
    assert (tmp_path / "shard.bin").read_bytes() == b"".join(bytes(part) for part in parts)


def test_a_short_write_goes_on_where_the_kernel_stopped(tmp_path, monkeypatch):
    real, written = os.writev, []

    def short(fd, buffers):  # as a kernel that takes at most 3001 bytes a call, mid-part
        left, taken = 3001, []
        for buffer in buffers:
            view = memoryview(buffer)[:left]
            taken.append(view)
            left -= view.nbytes
            if not left:
                break
        written.append(real(fd, taken))
        return written[-1]

    monkeypatch.setattr(local.os, "writev", short)
    parts = many_parts()
    Storage(str(tmp_path)).write_bytes("shard.bin", parts)
    data = b"".join(bytes(part) for part in parts)
    assert (tmp_path / "shard.bin").read_bytes() == data
    assert len(written) > len(data) // 3001 and max(written) == 3001
