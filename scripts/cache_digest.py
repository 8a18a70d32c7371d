"""What checking the token cache's digest adds to a load: the cache of --data-dir built (or found), then
its load timed with and without `shared_cache.verify`.

    python scripts/cache_digest.py --data-dir ../shared/data --cache-dir /tmp/fastpt-cache
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastpt.inputs import token_cache  # noqa: E402
from fastpt.files import shared_cache  # noqa: E402
from fastpt.inputs.models import load_tokenizer  # noqa: E402


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--model", default="tiny",
                        help="its tokenizer keys the cache (tiny: BERT's uncased vocabulary)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    splits, path = token_cache.prepare_splits(args.data_dir, args.cache_dir, tokenizer, token_cache.CACHE_MAX_LENGTH)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    reviews = sum(len(split) for split in splits.values())
    digest = best_of(args.repeats, lambda: shared_cache.verify(path))
    load = best_of(args.repeats, lambda: token_cache.load_cache(path, 512))  # verify included
    print(f"{path}: {reviews:,} reviews, {size / 1e6:.0f} MB of files")
    print(f"verify (SHA-256 of every file): {digest:.3f} s; load_cache with it: {load:.3f} s "
          f"(best of {args.repeats})")


if __name__ == "__main__":
    main()
