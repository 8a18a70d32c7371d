"""`python -m fastpt ...`: the same command line as `python train.py ...`."""

from fastpt.run import cli

if __name__ == "__main__":
    cli()
