"""Fine-tune DistilBERT on IMDB in plain PyTorch.

    python train.py                                  # the article's baseline
    python train.py --amp --compile --bucket         # single-device speed-ups
    torchrun --nproc_per_node=4 train.py --amp --compile --ddp

`python train.py --help` lists every flag; fastpt/ holds one module per technique.
"""

import sys

from fastpt.run import main

if __name__ == "__main__":
    sys.exit(main())
