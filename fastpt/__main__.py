"""`python -m fastpt ...`: the same command line as `python train.py ...`."""

import sys

from fastpt.run import cli

if __name__ == "__main__":
    sys.argv[0] = "python -m fastpt"  # what --help shows as the program (argparse would say __main__.py)
    cli()
