"""Fine-tune DistilBERT on IMDB in plain PyTorch: the whole run, in the order it happens.

    python train.py                                  # the article's baseline
    python train.py --amp --compile --pack           # single-device speed-ups
    python train.py --data my.csv --label-column y   # your own data (fastpt/inputs/own_data.py)
    torchrun --nproc_per_node=4 train.py --amp --compile --ddp

Start reading here. `train` is the run as the articles' scripts write it: build, then for each
epoch train, validate without gradients, keep the best checkpoint and stop early; then test
the best weights. Every line leads to one place in fastpt/ (fastpt/__init__.py is the map);
`fastpt/loop/step.py` holds the training step itself (forward under autocast, loss, backward,
optimizer step). `main` is the command line around it: flags, the run folder, exit statuses.
"""

from fastpt.cli.shell import CommandLine, exit_process


def train(cfg, dist, inputs, out_dir, resume_state=None) -> dict:
    """One run: what Lightning's `Trainer.fit` and `Trainer.test` do, written out. Returns results.json."""
    # torch and transformers load here, after the flags: --help answers at once
    import torch

    from fastpt.cli import outputs
    from fastpt.loop import checkpoints
    from fastpt.loop.build import build
    from fastpt.loop.evaluation import evaluate
    from fastpt.loop.step import max_steps_reached, train_epoch
    from fastpt.strategies import build_strategy

    strategy = build_strategy(cfg, dist)  # one device, DDP, FSDP or DeepSpeed (fastpt/strategies/)
    # Built in one fixed order: loaders -> the model (packed) -> forward_loss, eval_sums -> bookkeeping (loop/build.py)
    with build(cfg, dist, inputs, strategy, out_dir, resume_state) as parts:
        loaders, bookkeeping, record, tracker = parts.loaders, parts.bookkeeping, parts.record, parts.tracker
        position, clocks = bookkeeping.position, bookkeeping.clocks
        # to device -> compile -> DDP / FSDP / DeepSpeed engine -> optimizer, schedule (strategies/base.py)
        strategy.setup(parts.model, training_steps=parts.training_steps)
        # --compile-scope whole: forward, loss and metric sums compiled as one graph (speedups/compile.py)
        forward_loss, eval_sums = strategy.compile_step(parts.forward_loss), strategy.compile_step(parts.eval_sums)
        torch.manual_seed(cfg.seed + dist.rank)  # different dropout masks per rank
        ckpt_dir = out_dir / "checkpoints"
        if resume_state:
            checkpoints.restore(resume_state, ckpt_dir, dist, strategy, record)  # last.pt: weights, optimiser, RNG
        parts.stopper.install()  # training starts: a signal now ends the step, saves last.pt and stops
        while (position.epoch < cfg.epochs and not record.early_stopping.stopped
               and not max_steps_reached(position.global_step, cfg.max_steps)):
            # This epoch's shuffle (after a resume: what is left of it); its clock, sums and progress bar.
            loaders.train_sampler.set_epoch(position.epoch, position.batch_in_epoch, record.epoch_offset)
            bookkeeping.start_epoch(len(loaders.train))
            for due in train_epoch(strategy, loaders.train, bookkeeping, forward_loss, cfg.grad_accum,
                                   cfg.max_steps):  # yields where last.pt is due: --save-every, or a signal
                checkpoints.save_last(ckpt_dir, parts.config, dist, strategy, bookkeeping, record,
                                      loaders.train_sampler)
                if due.stop:  # status 3, the message saying how to resume; or SLURM requeues the job
                    raise bookkeeping.due.stopped(due, position.global_step)
            train_metrics = bookkeeping.end_epoch()  # the epoch's loss and accuracy over all ranks
            # No gradients, larger batches, every rank its share; a NaN loss stops the run (no best.pt from it).
            val = evaluate(strategy, loaders.validation, eval_sums, tracker.bar(len(loaders.validation),
                           "validation"), clocks.compile_clock, len(inputs.label_names))
            record.add_validation(val, position)
            monitored = val[cfg.monitor.removeprefix("val_")]  # --monitor val_acc (default), val_loss, val_macro_f1
            improved = record.best.update(monitored, position.epoch + 1)  # strictly better than every epoch before
            if improved:
                checkpoints.save_best(ckpt_dir, parts.config, dist, strategy, position.epoch + 1, position.global_step,
                                      monitored)
            record.early_stopping.update(monitored)  # --early-stopping-patience: Lightning's rule, exactly
            record.end_epoch(train_metrics, val, improved, position, clocks, tracker)  # the epoch's line, TensorBoard
            if cfg.save_every is not None:
                checkpoints.save_last(ckpt_dir, parts.config, dist, strategy, bookkeeping, record,
                                      loaders.train_sampler)
        # The weights to test: best.pt's (--test-on best), sent to every rank.
        record.tested_on = checkpoints.load_best(ckpt_dir, cfg.test_on, dist, strategy)
        test = evaluate(strategy, loaders.test, eval_sums, tracker.bar(len(loaders.test), "test"),
                        clocks.compile_clock, len(inputs.label_names), per_example=True)
        results = outputs.write_results(tracker, cfg, dist, strategy, bookkeeping, record, inputs, loaders, test)
        # Each test example once, in the split's order: its text, gold and predicted label, probabilities.
        outputs.write_predictions(out_dir, cfg, dist, inputs, test, tracker)
        if cfg.export_dir:  # the tested weights as a Hugging Face model folder (pipeline loads it)
            outputs.export(cfg.export_dir, dist, strategy, inputs, tracker)
        return results


def main(argv=None) -> int:
    """The command: returns its exit status (0 done, 1 failed, 2 bad input, 3 stopped; fastpt/cli/shell.py)."""
    shell = CommandLine(argv)
    with shell.exit_status():  # whatever stops the command below: one line on stderr, and its status
        cfg, dist = shell.parse()  # flags, checks, the device; under torchrun, the process group
        from fastpt.loop.build import load_inputs
        # Its lock; a new run, or what last.pt resumes. The config resolved: absolute paths, a resize's batch.
        cfg, out_dir, resume_state = shell.claim_run_folder()
        inputs = load_inputs(cfg, dist)  # tokenizer, model, tokenised splits: bad input stops here
        cfg = shell.start_run(inputs)  # the run folder's first write (config.json); the IMDB folder found
        train(cfg, dist, inputs, out_dir, resume_state)
    return shell.status


def cli() -> None:
    """The `fastpt-train` command (installed as fastpt/start/train.py) and `python -m fastpt`."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())  # sys.exit; a torchrun worker skips the interpreter's teardown (gloo can abort it)
