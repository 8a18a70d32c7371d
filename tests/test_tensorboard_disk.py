"""A full disk under TensorBoard's writer: one line and status 1, never a traceback from two threads.

TensorBoard writes its event file from a thread of its own; the failure is raised again in the
main thread at the next call. The disk fills (a) as the event file is created, (b) mid-training.
"""

from __future__ import annotations

import errno

import pytest
from tensorboard.summary.writer import record_writer

from fastpt.cli.shell import EXIT_FAILED
from train import main


@pytest.mark.parametrize("writes_before_full", [0, 12], ids=["creating the event file", "mid-training"])
def test_a_full_disk_under_tensorboard_is_one_line(tiny_args, tmp_path, monkeypatch, capfd, writes_before_full):
    original, writes = record_writer.RecordWriter.write, []

    def write(self, data):
        writes.append(len(data))
        if len(writes) > writes_before_full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    out = tmp_path / "run"
    capfd.readouterr()
    assert main(tiny_args(out=out)) == EXIT_FAILED
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "Exception in thread" not in captured.err, captured.err[-3000:]
    errors = [line for line in captured.err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"no space left in {out / 'tb'}" in errors[0], captured.err[-3000:]
    assert "--no-tensorboard" in errors[0], errors  # the way around it
