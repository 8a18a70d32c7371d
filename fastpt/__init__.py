"""fastpt: every training speed-up of two well-known write-ups, in plain PyTorch. The map:

Start at train.py (beside this package): the run in the order it happens.

Read these, the lessons:
    loop/        the training loop and what it is made of
        step.py            the training step and the epoch loop, as the textbook writes them
        evaluation.py      no_grad evaluation, larger batches, split across ranks
        inference.py       predictions on new texts: inference_mode, length-sorted large batches
        early_stopping.py  Lightning's EarlyStopping and best-checkpoint rules, exactly
        build.py           the build step: inputs, loaders, model, strategy.setup, bookkeeping, as plain parts
        record.py          the run's record: history, best epoch, early stopping, validation time
        bookkeeping.py     counters, device-side sums, clocks and the epoch's console line
    speedups/    one module per single-device technique, each with what / why faster / cost / Lightning flag
        amp.py             mixed precision (autocast, GradScaler)
        compile.py         torch.compile, dynamic shapes, CUDA graphs
        packing.py         padding-free batches: reviews end to end, the head on each one's first token
        packed_attention.py  attention inside each review: varlen, a per-review loop, a block mask
        bucketing.py       length-grouped batches
        backends.py        TF32, deterministic kernels, the compile cache
    strategies/  one device, DDP, FSDP2, DeepSpeed ZeRO behind one small interface (base.py first)
        optimizer.py       Adam or AdamW (Trainer's no-decay groups), the learning-rate schedule and warmup
        deepspeed.py       the ZeRO engine; deepspeed_config.py its JSON from the flags,
                           deepspeed_checkpoint.py its checkpoint files loaded safely
    inputs/      what the run trains on
        data.py            samplers, collators and DataLoaders (workers, pinned memory)
        device_data.py     the tokenised data kept on the device, batches gathered there
        token_cache.py     IMDB tokenised once, cached, loaded in a second
        imdb.py            the articles' exact 35k/5k/10k split
        own_data.py        your own table (--data): split, tokenised and cached the same way
        tables.py          reading it: CSV, TSV, JSON Lines, Parquet, a saved dataset, the Hub
        columns.py         its text, pair and label columns (per file), labels read by one rule
        models.py          the models and tokenizers, online or offline

Skip these on a first read, the machinery a real run needs:
    config.py    every setting of a run: one typed dataclass, validated once; read by every layer
    errors.py    the run's exceptions, each with its exit status
    files/       what lands on disk: checkpoints (atomic, weights_only, RNG states),
                 shared_cache (a cache folder shared by runs and users: lock, atomic publish, digests)
                 and trust (whose files a run may use on a shared node: the owner rule, FASTPT_TRUST_DIRS)
    cluster/     the processes: distributed (process group, collectives), slurm (srun's process group,
                 requeue before a time limit), signals (graceful stop), resize (resume on another
                 number of processes)
    monitoring/  what a run reports: metrics (throughput, MFU, memory), peak (the device's measured
                 FLOP/s), tracking (console, TensorBoard)
    cli/         the command line: args (flags), shell (checks, exit statuses), run_folder (lock, resume plan),
                 outputs (what a run writes in its folder: best.pt, last.pt, results.json, predictions.csv,
                 the export), predictions (that file's columns), predict (the fastpt-predict command)

Imports go one way, down this order: cli/ -> loop/ -> strategies/ -> inputs/ -> speedups/ -> monitoring/
-> cluster/ -> files/ -> config.py, errors.py; no folder imports one above it (tests/test_layout.py holds that).
"""
