"""How an exception becomes fastpt's one-line error message."""

from __future__ import annotations


def one_line(e: BaseException, limit: int | None = None) -> str:
    """The message on one line (some, tarfile's or Hugging Face's, span several), cut at `limit` characters."""
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."
