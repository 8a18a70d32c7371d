"""Scripts that use an extra (matplotlib, Lightning) say which install line it takes, in one line.

After the set-up alone (`scripts/setup.sh`: the runtime only), `scripts/reproduce.py` and
`scripts/bench_single.py` still write their tables and skip the chart with one line, and
`scripts/peers/lightning_ref.py` stops with one line and status 2 instead of a traceback.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("module,function", [("reproduce", "chart"), ("bench_single", "bar_chart")])
def test_chart_without_matplotlib_is_skipped_in_one_line(module, function, monkeypatch, tmp_path, capsys):
    draw = getattr(__import__(module), function)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    rows = [] if module == "reproduce" else [{"name": "fp32", "samples_per_s": 1.0}]
    assert draw(rows, tmp_path / "chart.png", "title") is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install matplotlib" in err, err
    assert not (tmp_path / "chart.png").exists()


def test_lightning_reference_without_lightning_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setattr(sys, "argv", ["lightning_ref.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "scripts" / "peers" / "lightning_ref.py"), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -r requirements-peers.txt" in err, err
