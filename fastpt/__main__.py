"""`python -m fastpt ...`: the same command line as `python train.py ...`.

train.py sits beside the fastpt package, in the repository and where `pip install .` puts it; it is
loaded from there, so another train.py in the current folder is never picked up instead.
"""

import importlib.util
import sys
from pathlib import Path


if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("train", Path(__file__).resolve().parent.parent / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules["train"] = train
    spec.loader.exec_module(train)
    sys.argv[0] = "python -m fastpt"  # what --help shows as the program (argparse would say __main__.py)
    train.cli()
