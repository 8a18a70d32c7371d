"""Every flag of train.py survives torchrun's own parser: `torchrun ... train.py --flag value`.

torchrun reads the whole command line with argparse before it hands the script its arguments,
and argparse matches prefixes: a script flag that is a prefix of one of torchrun's options
(`--monitor` of `--monitor-interval`) stops torchrun with "ambiguous option" before fastpt runs.
"""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.run import get_args_parser

from fastpt.cli.args import Gone, build_parser


def _flags():
    """(primary flag, a value it accepts or None for a switch) for every option of train.py."""
    for action in build_parser()._actions:
        if isinstance(action, (argparse._HelpAction, Gone)):  # help; a removed flag, refused by design
            continue
        flag = action.option_strings[0]  # the name the docs and --help use; aliases are for plain python
        if action.nargs == 0:
            yield flag, None
        elif action.choices:
            yield flag, str(list(action.choices)[-1])
        elif action.type is int:
            yield flag, "3"
        elif action.type is float:
            yield flag, "0.25"
        else:
            yield flag, "value"


FLAGS = list(_flags())


def test_the_list_covers_every_flag():
    assert len(FLAGS) > 60 and ("--monitor-metric", "val_macro_f1") in FLAGS


@pytest.mark.parametrize("flag,value", FLAGS, ids=[f for f, _ in FLAGS])
def test_flag_reaches_the_script_through_torchrun(flag, value):
    script_args = [flag] if value is None else [flag, value]
    forms = [script_args] if value is None else [script_args, [f"{flag}={value}"]]
    for args in forms:
        parsed = get_args_parser().parse_args(["--nproc_per_node=2", "train.py", *args])
        assert parsed.training_script == "train.py"
        assert parsed.training_script_args == args
        # and train.py's own parser takes it back (its value lands in the right setting)
        ours = build_parser().parse_args(args)
        action = next(a for a in build_parser()._actions if flag in a.option_strings)
        assert getattr(ours, action.dest) is not None


def test_the_old_monitor_name_still_works_without_torchrun():
    assert build_parser().parse_args(["--monitor", "val_loss"]).monitor == "val_loss"
    assert build_parser().parse_args(["--monitor-metric", "val_loss"]).monitor == "val_loss"


def test_abbreviations_are_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--monitor-m", "val_loss"])
