"""The errors a run reports in one line, and how an exception becomes that line.

The classes live here, apart from the modules that raise them (they import torch and
transformers), so that the command line can tell them apart without loading either.
"""

import errno


def one_line(e: BaseException, limit: int | None = None) -> str:
    """The message on one line (some, tarfile's or Hugging Face's, span several), cut at `limit` characters."""
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def disk_full(e: BaseException | None) -> bool:
    """Whether e, or an error it was raised while handling, says the disk or quota is full.

    torch.save reports a full disk as a RuntimeError of its zip writer raised while handling the OSError."""
    while e is not None:
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)):
            return True  # pyarrow's writers raise OSError("... No space left on device") without an errno
        e = e.__cause__ or e.__context__
    return False


class DataError(RuntimeError):
    """The dataset cannot be found, downloaded or read. The message says what to do."""


class ModelError(RuntimeError):
    """The model or tokenizer cannot be loaded. The message says what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run."""


class DiskFull(CheckpointError):
    """A run file could not be written for lack of space; the previous file, if any, is intact."""


class NonFiniteLoss(RuntimeError):
    """Training diverged: the loss became NaN or infinite, or float16's scaler skipped step after step."""


EXIT_STOPPED = 3


class StopRequested(Exception):
    """Raised by the loop after it saved last.pt in answer to a signal."""


class Requeued(StopRequested):
    """The stop after SLURM's warning signal, with the job put back in the queue (slurm.py): status 0."""
