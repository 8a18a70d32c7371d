"""The commands the README and docs/ show still parse: every flag they give `train.py` or
`fastpt-predict` is one the command's parser knows, with a value among its choices.

The commands are read where a reader copies them from: fenced code blocks, inline code that
starts a command, and the flag column of a table. Prose is not read."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fastpt.cli.args import build_parser as train_parser
from fastpt.cli.predict import build_parser as predict_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_SHELL = {"yaml", "yml", "json", "python", "toml"}
# A token that starts train.py's command line (everything after it is train.py's) or fastpt-predict's.
TRAIN = re.compile(r"(^|/)(train\.py|train\.sh|fastpt-train|[\w.-]+\.sbatch)$")
PREDICT = re.compile(r"(^|/)fastpt-predict$")


def fenced_blocks(text: str):
    """(language, the block's lines joined where a line ends in a backslash)."""
    for match in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.M | re.S):
        yield match.group(1).lower(), match.group(2).replace("\\\n", " ")


def inline_commands(text: str):
    """Inline code that holds a command (`python train.py --help`), outside fenced blocks and tables."""
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)
    prose = "\n".join(line for line in prose.splitlines() if not line.lstrip().startswith("|"))
    for span in re.findall(r"`([^`\n]+)`", prose.replace("\n", " ")):
        yield span


def table_flag_cells(text: str):
    """The cells of every table column headed 'flag': train.py's flags, one technique a row."""
    column = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if column is None:
            column = cells.index("flag") if "flag" in cells else -1
        elif column >= 0 and not set(line) <= set("|- :") and column < len(cells):
            yield cells[column]


def split(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote inside a longer line: whitespace is enough for flags
        return command.split()


def program_args(tokens: list[str]):
    """(program, its arguments) for each fastpt command in one command line."""
    for i, token in enumerate(tokens):
        if TRAIN.search(token) or tokens[i - 1:i + 1] == ["-m", "fastpt"]:
            yield "train.py", tokens[i + 1:]
            return
        if PREDICT.search(token) or tokens[i - 1:i + 1] == ["-m", "fastpt.cli.predict"]:
            yield "fastpt-predict", tokens[i + 1:]
            return


def commands():
    """(file, program, arguments) for every command the docs show."""
    for doc in DOCS:
        text = doc.read_text()
        lines = [body for lang, body in fenced_blocks(text) if lang not in NOT_SHELL]
        lines = [line for body in lines for line in body.splitlines()] + list(inline_commands(text))
        for line in lines:
            for program, args in program_args(split(line)):
                yield doc.name, program, args
        for cell in table_flag_cells(text):
            yield doc.name, "train.py", re.findall(r"--[a-z][a-z0-9-]*", cell.replace("\\|", "|"))


PARSERS = {"train.py": train_parser(), "fastpt-predict": predict_parser()}
COMMANDS = list(commands())


def unknown(program: str, args: list[str]) -> list[str]:
    """What the program's parser would refuse: an unknown flag, or a literal value outside its choices."""
    actions = PARSERS[program]._option_string_actions
    wrong = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, _, value = arg.partition("=")
        if flag not in actions:
            wrong.append(flag)
            continue
        action = actions[flag]
        value = value or (args[i + 1] if i + 1 < len(args) and action.nargs != 0 else "")
        literal = value and not value.startswith(("$", "-", ".")) and not value.isupper() and "|" not in value
        if action.choices and literal:
            try:
                known = (action.type or str)(value) in action.choices
            except ValueError:
                known = False
            if not known:
                wrong.append(f"{flag} {value}")
    return wrong


def test_the_docs_show_commands_of_both_programs():
    """The reader below reads something: both commands, from the README and from docs/."""
    programs = {(doc == "README.md", program) for doc, program, _ in COMMANDS}
    assert programs >= {(True, "train.py"), (False, "train.py"), (False, "fastpt-predict")}, programs
    assert len(COMMANDS) > 40, len(COMMANDS)


@pytest.mark.parametrize("doc", [d.name for d in DOCS])
def test_every_flag_the_docs_use_is_known_to_the_command(doc):
    wrong = [(program, " ".join(args), bad) for name, program, args in COMMANDS if name == doc
             for bad in [unknown(program, args)] if bad]
    assert not wrong, "\n".join(f"{program} {args}: {bad}" for program, args, bad in wrong)


@pytest.mark.parametrize("line,wrong", [
    ("python train.py --amp --no-such-flag", ["--no-such-flag"]),
    ("torchrun --nproc_per_node=2 train.py --ddp --amp-dtype float8", ["--amp-dtype float8"]),
    ("fastpt-predict --model runs/x --checkpoint newest", ["--checkpoint newest"]),
    ("torchrun --nproc_per_node=4 --rdzv-backend=c10d train.py --ddp --out runs/a", []),  # torchrun's own flags
    ("sbatch --nodes=4 scripts/slurm/srun.sbatch --pack --epochs 1", []),  # sbatch's, then train.py's
])
def test_the_reader_finds_what_a_parser_would_refuse(line, wrong):
    found = [bad for program, args in program_args(split(line)) for bad in unknown(program, args)]
    assert found == wrong
