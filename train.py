"""Fine-tune DistilBERT on IMDB in plain PyTorch.

    python train.py                                  # the article's baseline
    python train.py --amp --compile --pack           # single-device speed-ups
    torchrun --nproc_per_node=4 train.py --amp --compile --ddp

`python train.py --help` lists every flag; fastpt/ holds one module per technique. To read how
a step is computed, start at `train` below: three calls down is the backward pass.
"""

import sys

from fastpt.run import main


def train(trainer) -> dict:
    """The run: fastpt/trainer.py `Trainer.fit` builds the model and loaders, then for each epoch
    calls fastpt/step.py `train_epoch`, whose loop calls `train_step` (forward under autocast,
    loss, backward, optimizer step) on every batch, then validates; at the end it tests."""
    return trainer.fit()


if __name__ == "__main__":
    # Flags, checks, the run folder and exit statuses: fastpt/run.py (the command-line shell).
    sys.exit(main(train=train))
