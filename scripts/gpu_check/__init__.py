"""The prepared GPU check: the articles' configurations, by fastpt and by Lightning, on one GPU.

Run it through its wrapper when a CUDA GPU is at hand (or `--dry` on the CPU, to prove it first):

    bash scripts/gpu_check.sh --out DIR          # on a machine with one CUDA GPU: under 8 minutes
    bash scripts/gpu_check.sh --dry --out DIR    # the same script end to end on the CPU (tiny model)

`scripts/gpu_check.sh` prepares the machine (staged wheels, offline tokenizer, data) and calls
`python scripts/gpu_check run`. Every row is a separate process on the full-size
distilbert-base-uncased architecture with random weights (speed does not depend on the weights),
512 tokens, batch 12, for a bounded number of steps; results.json of each run gives the numbers:

1. fastpt's best single-GPU configuration (plan.BEST_FLAGS);
2. its real full run (3 epochs of 35,000 reviews, validation and test), timed end to end;
3. a probe of it (`scripts/bench_single.py probe`): a steady-state window under
   torch.cuda.set_sync_debug_mode("error"), where any synchronising call fails the check, then a
   profiler table of the top kernels;
4. the articles' configurations, fp32, `--amp` (16-mixed) and `--amp --compile`, each run by
   fastpt and then by the articles' Lightning Trainer (scripts/peers/lightning_ref.py) on the
   same reviews, back to back (A B A B), so each identical pair is a ratio measured side by side;
5. `--amp --deepspeed` in one process, where deepspeed imports.

Rows run in that order, most valuable first: the best row and its full run are the headline,
and 2 and 3 reuse the Inductor cache 1 left warm. A row starts only if 1.5 times its estimate
(from the rows before it) fits in the time left; otherwise it is marked "skipped for time",
which is not a failure. Its timeout, at least that 1.5 times, stops a hung row only.
Written to --out (flat, at most 8 files): gpu_check.md, gpu_check.json, gpu_check.png and
profile.txt (the wrapper adds gpu_check.log).

The parts, by what they do:
    plan.py      the rows, each row's command, the budget and the planner that starts a row where it fits
    run.py       the set-up checks, one row as a process, the whole run
    report.py    gpu_check.md, gpu_check.json, gpu_check.png
    stage.py     the staged wheels' requirements and the offline tokenizer (for scripts/device_stage.sh)
    __main__.py  the command line: run, stage-tokenizer, wheels
"""
