"""fastpt: every training speed-up of two well-known write-ups, in plain PyTorch. The map:

Start at train.py (beside this package): the run in the order it happens.

Read these, the lessons:
    loop/        the training loop and what it is made of
        step.py            the training step and the epoch loop, as the textbook writes them
        evaluation.py      no_grad evaluation, larger batches, split across ranks
        checkpoints.py     best.pt and last.pt: saved atomically, the best weights tested, a run resumed
        early_stopping.py  Lightning's EarlyStopping and best-checkpoint rules, exactly
        inference.py       predictions on new texts: inference_mode, length-sorted large batches
        build.py           the build step: inputs (what the data decides too), the model, bookkeeping, as plain parts
        loaders.py         the run's DataLoaders: each rank its share of every global batch
        record.py          the run's record: history, best epoch, early stopping, validation time
        bookkeeping.py     around the step, one part per concern: position, device-side sums, clocks, what is due
    speedups/    one module per single-device technique, each with what / why faster / cost / Lightning flag
        amp.py             mixed precision (autocast, GradScaler)
        compile.py         torch.compile: its two scopes (each layer, the whole step), dynamic shapes,
                           CUDA graphs, the compile cache
        packing.py         padding-free batches: reviews end to end, the head on each one's first token
        packed_attention.py  attention inside each review: varlen, a per-review loop, a block mask
        attention_precision.py  attention on a CPU under --amp: in 16 bits or on float32 copies, measured
        prepacked.py       fastpt-predict on a CPU in bfloat16: linear weights in oneDNN's layout, packed once
        bucketing.py       length-grouped batches
        backends.py        TF32, deterministic kernels, a compiled run's settings set and undone
    strategies/  one device, DDP, FSDP2, DeepSpeed ZeRO behind one small interface (base.py first);
                 train.py calls strategy.setup: to device -> compile -> apply_ddp / apply_fsdp / the engine
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
        model_folder.py    a local model folder checked before loading: weight files, shapes, size

Skip these on a first read, the machinery a real run needs:
    config.py    every setting of a run: one typed dataclass, validated once, frozen; read by every layer
                 (config_rules.py: the choices, the switches settings need, what a resume compares, the checks)
    errors.py    the run's exceptions, each with its exit status
    files/       what lands on disk: checkpoints (atomic, weights_only, RNG states),
                 shared_cache (a cache folder shared by runs and users: atomic publish, digests;
                 cache_lock its build lock)
                 and trust (whose files a run may use on a shared node: the owner rule, FASTPT_TRUST_DIRS)
    cluster/     the processes: distributed (process group, collectives), slurm (srun's process group,
                 requeue before a time limit), signals (graceful stop), resize (resume on another
                 number of processes)
    monitoring/  what a run reports: metrics (throughput, MFU, memory), peak (the device's measured
                 FLOP/s), tracking (console, TensorBoard)
    cli/         the command line: args (flags), shell (the command's steps, exit statuses), preflight (checks,
                 the resolved config, notes), run_folder (the resume plan; run_lock its lock, run_files what it
                 holds, resume_check what a resume must match), outputs (what a run writes once
                 it has tested: results.json, predictions.csv, the export), predictions (that file's
                 columns), predict (the fastpt-predict command)

Imports go one way, down this order: cli/ -> loop/ -> strategies/ -> inputs/ -> speedups/ -> monitoring/
-> cluster/ -> files/ -> config.py (on config_rules.py), errors.py; no folder imports one above it
(tests/test_layout.py holds that).
"""
