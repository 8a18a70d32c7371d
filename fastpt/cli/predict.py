"""fastpt-predict: a trained model's predictions on new texts, written as CSV or JSON Lines.

    fastpt-predict --model runs/reviews --data new.csv --out predictions.csv
    fastpt-predict --model exported/ --data new.jsonl --out predictions.jsonl --batch-size 128 --amp bfloat16
    fastpt-predict --model exported/ --data new.csv --out predictions.csv --pack      # no padding tokens
    torchrun --nproc_per_node=4 -m fastpt.cli.predict --model ... --data ... --out ...   # rank 0 writes

--model is a folder train.py wrote: an export (--export-dir: a Hugging Face model folder, which
`transformers.pipeline` loads too) or a run folder (--out: checkpoints/best.pt, or last.pt with
--checkpoint last; the model, labels, columns and --max-length are the run's). --data is a file
of the types training reads (.csv, .tsv, .jsonl / .json, .parquet; own_data.py reads it). A text
column is needed; with a label column the command also evaluates (accuracy and macro-F1 printed,
the gold labels written beside the predictions). The output's columns: cli/predictions.py; the
fast path: loop/inference.py. --pack lays the sorted texts end to end in streams of --pack-tokens
tokens (default: --batch-size x the texts' mean length) instead of padded batches; the same
predictions (float rounding aside), refused where training refuses --pack (the model's type).

Bad input is one line `error: ...` and status 2, with nothing written: a missing file, an unknown
column, a text that is no valid text (a lone surrogate), a folder that is neither an export nor a run
folder, weights that are not tensors or do not fit the folder's config.json, an existing --out without
--overwrite, an --out that is a folder, --pack on a model it does not support. The label column may
hold the label names, or, for a run whose --label-names named integer labels, those integers.
transformers' own reports and progress bars show with --verbose.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from fastpt.cli.args import DefaultsFormatter, OneLineParser
from fastpt.cli.predictions import output_format, preview, write_predictions
from fastpt.cli.run_folder import MARKER
from fastpt.cli.shell import exit_process, quiet_libraries
from fastpt.errors import CheckpointError, DataError, DiskFull, ModelError, one_line


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="fastpt-predict", formatter_class=DefaultsFormatter, allow_abbrev=False,
                      description="Predict labels for new texts with a model fastpt trained (labels in the file: "
                                  "evaluate too).")
    p.add_argument("--model", required=True, help="an --export-dir folder, or a run folder (its --out)")
    p.add_argument("--data", required=True, help="the texts: a .csv, .tsv, .jsonl or .parquet file")
    p.add_argument("--out", required=True, help="where to write the predictions: .csv, or .jsonl (JSON Lines)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--text-column", help="the texts' column (default: the run's, else 'text')")
    p.add_argument("--text-pair-column", help="second texts of sentence pairs (default: the run's)")
    p.add_argument("--label-column", help="gold labels, to evaluate; an error if missing when given "
                                          "(default: the run's, else 'label', used where the file has it)")
    p.add_argument("--checkpoint", choices=("best", "last"), help="a run folder's weights (default: best.pt, "
                                                                  "else last.pt)")
    p.add_argument("--batch-size", type=int, help="texts per batch (default: 16 on a CPU, where small batches measured "
                                                  "faster, 64 on a GPU; scripts/bench_predict.py measures)")
    p.add_argument("--max-length", type=int, help="tokens per text (default: the run's, else the model's limit)")
    p.add_argument("--amp", choices=("bfloat16", "float16"),
                   help="run the model in this dtype, its weights cast once (loop/inference.py; default: float32)")
    p.add_argument("--pack", action="store_true", help="no padding: the texts end to end in token streams "
                                                       "(DistilBERT, BERT, RoBERTa; speedups/packing.py)")
    p.add_argument("--pack-tokens", type=int, help="with --pack: tokens per stream (default: --batch-size x the "
                                                   "texts' mean length; a longer text goes alone)")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if there is a GPU), cpu, cuda")
    p.add_argument("--verbose", action="store_true", help="show the libraries' own reports and progress bars "
                                                          "(transformers' weight loading)")
    return p


def check_paths(args) -> None:
    """What needs no model and no data: the output's type, an existing output, the input file, the folder."""
    out, data, model = Path(args.out), Path(args.data), Path(args.model)
    output_format(out)
    for failed, error, message in (
            (any(given is not None and given < least for given, least in ((args.batch_size, 1), (args.max_length, 2))),
             ValueError,
             "--batch-size must be at least 1 and --max-length at least 2"),
            (args.pack_tokens is not None and (not args.pack or args.pack_tokens < 1), ValueError,
             "--pack-tokens needs --pack and a positive number of tokens"),
            (not data.is_file(), DataError, f"--data {data}: no such file"),
            # --overwrite replaces a file, never a folder
            (out.is_dir(), ValueError, f"--out {out} is a folder; name the predictions' file (.csv or .jsonl)"),
            (not out.parent.is_dir(), ValueError, f"--out {out}: no folder {out.parent}; create it first"),
            (out.exists() and data.resolve() == out.resolve(), ValueError,
             f"--out {out} is the --data file; write the predictions elsewhere"),
            (out.exists() and not args.overwrite, ValueError, f"--out {out} exists; pass --overwrite to replace it"),
            (not model.is_dir(), ModelError, f"--model {model}: no such folder")):
        if failed:
            raise error(message)


def load_trained(folder: Path, which: str | None):
    """(model, tokenizer, label names, the run's settings) from an export or a run folder; ModelError if neither."""
    from fastpt.inputs.models import load_model, load_tokenizer

    checkpoints = folder / "checkpoints"
    if (folder / MARKER).is_file() or checkpoints.is_dir():  # a run folder
        candidates = [which] if which else ["best", "last"]
        found = [checkpoints / f"{name}.pt" for name in candidates if (checkpoints / f"{name}.pt").is_file()]
        if not found:
            raise ModelError(f"--model {folder} is a run folder without checkpoints/{' or '.join(candidates)}.pt")
        from fastpt.files import checkpoint
        state = checkpoint.load(path := found[0])  # weights_only
        training = state.get("training")
        weights = state.get("model") or (training.get("model") if isinstance(training, dict) else None)
        if not isinstance(weights, dict) or not isinstance(state.get("config"), dict):
            raise CheckpointError(f"{path} holds no model weights and config (a DeepSpeed run's last.pt keeps its "
                                  f"weights in checkpoints/deepspeed/): use best.pt or an --export-dir folder")
        run = state["config"]
        names = [str(n) for n in run.get("label_names") or ("neg", "pos")]
        model = load_model(run["model"], True, run.get("attn_implementation", "sdpa"),
                           names if run.get("data") else None)  # IMDB's model keeps LABEL_0/1 in its config
        model.load_state_dict(weights)
        return model, load_tokenizer(run["model"]), names, run
    if (folder / "config.json").is_file():  # an export
        from transformers import AutoModelForSequenceClassification

        from fastpt.inputs.models import check_model_folder
        check_model_folder(folder)  # the weights transformers will load: tensors only, the config's shapes
        tokenizer = load_tokenizer(str(folder))
        try:
            model = AutoModelForSequenceClassification.from_pretrained(str(folder), attn_implementation="sdpa")
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot load the model in {folder}: {one_line(e, limit=200)}") from None
        names = [str(model.config.id2label[i]) for i in range(model.config.num_labels)]
        limit = min(tokenizer.model_max_length, getattr(model.config, "max_position_embeddings", 512))
        return model, tokenizer, names, {"max_length": limit,
                                         "data_label_names": getattr(model.config, "fastpt_data_label_names", None)}
    raise ModelError(f"--model {folder} is neither an export folder (config.json and weights, from --export-dir) "
                     f"nor a run folder ({MARKER}, checkpoints/best.pt)")


def read_texts(args, run: dict, names: list):
    """(table, columns, gold label ids or None) from --data, checked the way training checks its own data."""
    from fastpt.inputs.columns import check_texts, read_labels, resolve_columns
    from fastpt.inputs.tables import accepted_names, read_file

    table = read_file(Path(args.data))
    label = args.label_column or run.get("label_column") or "label"
    columns = SimpleNamespace(text_column=args.text_column or run.get("text_column") or "text",
                              text_pair_column=args.text_pair_column or run.get("text_pair_column"),
                              label_column=label if args.label_column or any(
                                  name in table.columns for name in accepted_names(label, table.columns))
                              else None)
    resolve_columns(table, columns, training=True)  # table.use: each flag's column in this file
    for use in ("text", "pair") if columns.text_pair_column else ("text",):
        check_texts(table, table.use[use])
    if columns.label_column is None:
        return table, columns, None
    read_labels(table, table.use["label"])
    index = {name: i for i, name in enumerate(names)}
    # A run whose --label-names named integer labels: the file may hold those integers, as training's did.
    index.update({str(own): i for i, own in enumerate(run.get("data_label_names") or []) if str(own) not in index})
    values = [str(table.label_names[v]) if table.label_names else str(v) for v in table.columns[table.use["label"]]]
    unknown = next((i for i, v in enumerate(values) if v not in index), None)
    if unknown is not None:
        raise DataError(f"{table.where}: {table.place(unknown)}: label {values[unknown]!r} is not one the model "
                        f"knows ({', '.join(map(repr, names))})")
    return table, columns, [index[v] for v in values]


def run(args, dist) -> None:
    import torch

    from fastpt.loop.build import check_model_fits, needs_token_types
    from fastpt.loop.evaluation import macro_f1
    from fastpt.loop.inference import (packed_prediction_loader, predict, prediction_loader, token_budget,
                                       tokenize)
    from fastpt.speedups import attention_precision, backends
    from fastpt.speedups.amp import DTYPES, check_dtype_supported
    from fastpt.speedups.prepacked import prepack_linears

    if dist.device.type == "cpu":  # as training does: big activations reuse freed memory, no fresh pages
        backends.keep_freed_memory()
    model, tokenizer, names, run_cfg = load_trained(Path(args.model), args.checkpoint)
    table, columns, gold = read_texts(args, run_cfg, names)
    check_model_fits(SimpleNamespace(pack=args.pack, text_pair_column=columns.text_pair_column), model, tokenizer)
    if args.amp:
        check_dtype_supported(args.amp, dist.device)
    max_length = args.max_length or run_cfg["max_length"]
    batch_size = args.batch_size or (16 if dist.device.type == "cpu" else 64)
    began = time.perf_counter()
    texts = table.columns[table.use["text"]]
    pairs = table.columns[table.use["pair"]] if columns.text_pair_column else None
    split = tokenize(tokenizer, texts, pairs, max_length)
    sep_id = tokenizer.sep_token_id if needs_token_types(columns, model.config) else None
    pad_id, pin = tokenizer.pad_token_id or 0, dist.device.type == "cuda"
    if args.pack:  # the training path's PackedClassifier and kernel choice (loop/build.py), never compiled here
        from fastpt.speedups.packed_attention import packed_attention_kernel
        from fastpt.speedups.packing import PackedClassifier
        model = PackedClassifier(model, packed_attention_kernel(dist.device.type, False, bool(args.amp)))
        tokens = args.pack_tokens or token_budget(split, batch_size)
        loader = packed_prediction_loader(split, tokens, pad_id, max_length, dist.rank, dist.world_size,
                                          pin_memory=pin)
        batching = f"pack {tokens} tokens ({model.kernel} attention)"
    else:
        loader = prediction_loader(split, batch_size, pad_id, max_length, dist.rank, dist.world_size, sep_id,
                                   pin_memory=pin)
        batching = f"batch {batch_size}"
    precision = attention_precision.for_predictions(args.amp, dist, model, loader)  # rank 0 measures
    model = attention_precision.apply(model, precision).to(dist.device, DTYPES.get(args.amp))
    prepacked = prepack_linears(model)  # bfloat16 on a CPU only
    out = predict(model, loader, dist.device, max_length)
    seconds = time.perf_counter() - began
    if not dist.is_main:
        return
    leading = {"row": table.row_numbers(), "text": [preview(t) for t in texts]}
    if gold is not None:
        leading["label"] = [names[i] for i in gold]
    write_predictions(Path(args.out), leading, names, out["predicted"], out["probabilities"])
    print(f"predicted {len(texts)} texts in {seconds:.2f} s ({len(texts) / seconds:.1f} texts/s, tokenising "
          f"included) | {batching} | max length {max_length} | {dist.device} x{dist.world_size} | "
          f"amp: {args.amp or 'off'}{f' ({prepacked} linear weights prepacked)' if prepacked else ''} | "
          f"torch {torch.__version__}"
          + (f" | malloc: {backends.cpu_allocator()}" if dist.device.type == "cpu" else ""))
    if line := attention_precision.describe(precision):  # measured: the choice and both times
        print(line)
    if gold is not None:
        confusion = [[0] * len(names) for _ in names]
        for truth, guess in zip(gold, out["predicted"]):
            confusion[truth][int(guess)] += 1
        correct = sum(row[i] for i, row in enumerate(confusion))
        print(f"evaluation: accuracy {correct / len(gold):.4f} macro-F1 {macro_f1(confusion):.4f} "
              f"on {len(gold)} labelled texts")
    print(f"wrote: {args.out}")


def main(argv=None) -> int:
    """The command; returns its exit status: 0 done, 2 bad input (one line, nothing written), 1 a full disk."""
    dist = None
    try:
        args = build_parser().parse_args(argv)
        check_paths(args)
        quiet_libraries(args.verbose)
        from fastpt.cluster import distributed
        dist = distributed.init(args.device)
        run(args, dist)
        return 0
    except SystemExit as e:  # argparse: --help (0), or a bad flag (2, its line printed)
        return e.code if isinstance(e.code, int) else 2
    except (ValueError, DataError, ModelError, CheckpointError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {one_line(e)}", file=sys.stderr)
        return 1 if isinstance(e, DiskFull) else 2
    finally:
        if dist is not None:
            from fastpt.cluster import distributed
            distributed.shutdown()


def cli() -> None:
    """The `fastpt-predict` command and `python -m fastpt.cli.predict`."""
    exit_process(main())


if __name__ == "__main__":
    cli()
