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
    from fastpt.loop.run import Run  # torch and transformers load here, after the flags: --help answers at once
    from fastpt.loop.step import max_steps_reached, train_epoch
    from fastpt.machinery.errors import StopRequested

    # Build, in one fixed order: loaders -> model -> strategy (to device, compile, DDP / FSDP /
    # DeepSpeed, optimizer) -> bookkeeping; after a resume, last.pt's state (fastpt/loop/run.py).
    with Run(cfg, dist, inputs, out_dir, resume_state) as run:
        bookkeeping = run.book  # where the run is: epoch, step, sums kept on the device, what is due
        while (bookkeeping.epoch < cfg.epochs and not run.early_stopping.stopped
               and not max_steps_reached(bookkeeping.global_step, cfg.max_steps)):
            run.start_epoch()  # this epoch's shuffle (after a resume: what is left of it)
            for due in train_epoch(run.strategy, run.train_loader, bookkeeping, run.forward_loss, cfg.grad_accum,
                                   cfg.max_steps):  # yields where last.pt is due: --save-every, or a signal
                run.save_last()
                if due.stop:
                    raise StopRequested(due.stop)  # status 3; the message says how to resume
            train_metrics = bookkeeping.end_epoch()
            val = run.evaluate("validation")  # no gradients, larger batches, every rank its share
            run.check_finite(val)  # a NaN validation loss stops the run: no best.pt from it
            monitored = val[cfg.monitor.removeprefix("val_")]  # --monitor val_acc (default), val_loss, val_macro_f1
            improved = run.best.update(monitored, bookkeeping.epoch + 1)  # strictly better than every epoch before
            if improved:
                run.save_best(monitored)  # checkpoints/best.pt
            run.early_stopping.update(monitored)  # --early-stopping-patience: Lightning's rule, exactly
            run.end_epoch(train_metrics, val, improved)  # the epoch's line, TensorBoard, last.pt
        run.load_best()  # the weights to test: best.pt's (--test-on best), sent to every rank
        test = run.evaluate("test")
        results = run.report(test)  # results.json
        if cfg.export_dir:
            run.export()  # the tested weights as a Hugging Face model folder (pipeline loads it)
        return results


def main(argv=None) -> int:
    """The command: returns its exit status (0 done, 1 failed, 2 bad input, 3 stopped; fastpt/cli/shell.py)."""
    shell = CommandLine(argv)
    with shell.exit_status():  # whatever stops the command below: one line on stderr, and its status
        cfg, dist = shell.parse()  # flags, checks, the device; under torchrun, the process group
        from fastpt.loop.run import load_inputs
        out_dir, resume_state = shell.claim_run_folder()  # its lock; a new run, or what last.pt resumes
        inputs = load_inputs(cfg, dist)  # tokenizer, model, tokenised splits: bad input stops here
        shell.start_run(inputs)  # the run folder's first write (config.json)
        train(cfg, dist, inputs, out_dir, resume_state)
    return shell.status


def cli() -> None:
    """The `fastpt-train` command (installed as fastpt/start/train.py) and `python -m fastpt`."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())  # sys.exit; a torchrun worker skips the interpreter's teardown (gloo can abort it)
