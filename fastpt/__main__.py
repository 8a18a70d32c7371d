"""`python -m fastpt ...` and the `fastpt-train` command: the same command line as `python train.py ...`.

train.py sits beside the fastpt package in the repository (where an editable install, `pip install -e .`,
finds it too), and in fastpt/start/ where `pip install .` puts it (pyproject.toml); it is loaded from
there by its path, so another train.py in the current folder is never picked up instead.
"""

import importlib.util
import sys
from pathlib import Path


def cli() -> None:
    """train.py's command line, wherever the install put train.py."""
    package = Path(__file__).resolve().parent
    path = package / "start" / "train.py"
    spec = importlib.util.spec_from_file_location("train", path if path.exists() else package.parent / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules["train"] = train
    spec.loader.exec_module(train)
    train.cli()


if __name__ == "__main__":
    sys.argv[0] = "python -m fastpt"  # what --help shows as the program (argparse would say __main__.py)
    cli()
