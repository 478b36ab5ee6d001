"""``polyrl plot``: a real PNG from a run's metrics.jsonl, and a clear message when matplotlib is absent."""

from __future__ import annotations

import json
import sys

import pytest

from polyrl.cli import main


def _run_dir(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_plot_draws_the_logged_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"step": s, "critic/score/mean": 0.1 * s, "actor/pg_loss": -0.2, "val/gsm8k/mean@1": 0.3} for s in (1, 2, 3)]
    run = _run_dir(tmp_path, rows)
    assert main(["plot", str(run)]) == 0
    png = run / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_of_a_run_without_plotted_metrics_is_an_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path, [{"step": 1, "something/else": 1.0}])
    assert main(["plot", str(run)]) == 2
    assert "holds none of the plotted metrics" in capsys.readouterr().err
    assert not (run / "curves.png").exists()


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    run = _run_dir(tmp_path, [{"step": 1, "critic/score/mean": 0.5}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'polyrl[plot]'" in err
    assert "Traceback" not in err


@pytest.mark.timeout(120)
def test_plot_of_extreme_values_draws_in_bounded_time(tmp_path):
    """One-ulp ranges (a resumed run's constant lr), values at the float range's ends, NaN and inf (issue 47):
    matplotlib's tick locator fails on a span that overflows a float, so such values are drawn at 1e300."""
    pytest.importorskip("matplotlib")
    rows = [{"step": 1, "critic/score/mean": 0.0001, "acc/mean": 1e308, "actor/ppo_kl": 5.0},
            {"step": 2, "critic/score/mean": 9.999999999999999e-05, "acc/mean": -1e308, "actor/ppo_kl": float("inf")},
            {"step": 3, "critic/score/mean": 0.0001, "acc/mean": float("nan"), "actor/ppo_kl": 5e-324}]
    run = _run_dir(tmp_path, rows)
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 10_000
