"""``polyrl view``: the HTML run report, rendered in headless Chromium and checked for what a person sees.

The run directory here is written by polyrl's own writers (the jsonl Tracker, the config dumper) plus
validation-generation JSONL files in both accepted layouts and a PNG grid; integration_tests/
test_view_profile_serve.py renders the report of a real training run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.cli import main
from polyrl.errors import DataError
from polyrl.report import (
    MAX_KEPT,
    MAX_POINTS,
    MetricsReader,
    ReportWriter,
    axis_limits,
    axis_ticks,
    read_generations,
    render_report,
    svg_panel,
    write_report,
)

ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"
#: The first curve colour (#1f77b4) and the grid image's colour, as RGB.
CURVE_RGB = (0x1F, 0x77, 0xB4)
GRID_RGB = (250, 20, 200)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    from polyrl.config.loader import to_yaml
    from polyrl.config.schema import PolyrlConfig
    from polyrl.tracking import Tracker

    run = tmp_path / "my-grpo-run"
    tracker = Tracker(["jsonl"], run, project="p", experiment="e")
    for step in range(0, 13):
        row = {"val/arithmetic/mean@1": 0.1 + 0.05 * step} if step % 4 == 0 else {}
        if step:
            row.update({"critic/score/mean": 0.2 + 0.04 * step, "response_length/mean": 30.0 - step,
                        "actor/pg_loss": 0.01 * (-1) ** step, "timing/step": 1.5, "timing/gen": 0.9,
                        "my_plugin/odd_metric": float(step % 3)})
        tracker.log(row, step)
    tracker.close()
    (run / "config.yaml").write_text(to_yaml(PolyrlConfig()))
    (run / "manifest.lock.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp==0.1.0"]\n')
    # verl's layout (trainer.validation_data_dir: one file per step, input/output/score)...
    val = run / "validation_generations"
    val.mkdir()
    (val / "8.jsonl").write_text("".join(json.dumps({"input": f"What is {i}+{i}? <verl prompt>", "output": f"{2 * i}",
                                                     "score": float(i % 2), "gts": str(2 * i), "step": 8}) + "\n"
                                         for i in range(20)))
    # ...and polyrl's (trainer.validation_data_dir=auto: RUN_DIR/generations/validation/<step>.jsonl), with a line
    # cut short by a crash and a training row that is not shown
    rows = [{"step": 12, "kind": "validation", "sample_id": "3/0", "uid": "3-ab", "data_source": "arithmetic",
             "prompt": "Compute 7*6 <&escaped>", "response": "The answer is 42", "response_length": 5,
             "ground_truth": "42", "score": 1.0, "reward": 1.0, "reward_extra": {"acc": True}},
            {"step": 4, "kind": "validation", "prompt": "Compute 1+1", "response": "3", "score": 0.0},
            {"step": 4, "kind": "train", "prompt": "a training prompt", "response": "x", "score": 0.0}]
    (run / "generations" / "validation").mkdir(parents=True)
    (run / "generations" / "validation" / "12.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                                                 + '{"step": 12, "pro')
    from PIL import Image

    grid = Image.new("RGB", (256, 128), GRID_RGB)
    (run / "images").mkdir()
    grid.save(run / "images" / "val_step_12.png")
    return run


def test_report_reads_both_generation_layouts(run_dir):
    gens = read_generations(run_dir)
    assert sorted(gens) == [4, 8, 12]
    assert len(gens[8]) == 20 and gens[8][3] == {"prompt": "What is 3+3? <verl prompt>", "response": "6",
                                                 "score": 1.0, "gts": "6"}
    assert gens[12] == [{"prompt": "Compute 7*6 <&escaped>", "response": "The answer is 42", "score": 1.0,
                         "kind": "validation", "sample_id": "3/0", "uid": "3-ab", "data_source": "arithmetic",
                         "response_length": 5, "ground_truth": "42", "reward": 1.0, "acc": True}]
    assert [s["prompt"] for s in gens[4]] == ["Compute 1+1"]


def test_report_is_self_contained(run_dir):
    page = render_report(run_dir)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    refs = re.findall(r"""(?:src|href)\s*=\s*["']?([^"' >]+)""", page)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs), refs
    assert "url(" not in page
    assert 'http-equiv="refresh"' not in page
    assert 'http-equiv="refresh"' in render_report(run_dir, live=True)


def test_report_in_chromium_shows_curves_samples_images_and_config(run_dir):
    from PIL import Image

    from polyrl.testing.browser import chromium_or_skip, render

    chromium = chromium_or_skip()
    assert main(["view", str(run_dir)]) == 0
    page = run_dir / "report.html"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report_unit.png"
    shown = render(page, shot, height=4200, chromium=chromium)
    dom = shown.dom
    # the curves: panels with the logged metrics, one polyline per drawn series, the last values in the legends
    for text in ("reward", "critic/score/mean", "validation", "val/arithmetic/mean@1", "policy loss",
                 "time per phase (s)", "timing/gen", "every other metric (1)", "my_plugin/odd_metric"):
        assert text in dom, text
    svg_lines = re.findall(r'<polyline[^>]*points="([^"]+)"', dom)
    assert len(svg_lines) >= 6 and all(len(p.split()) >= 2 for p in svg_lines)
    assert "(0.68)" in dom  # critic/score/mean at step 12
    # the samples, newest step open first, text escaped
    assert (dom.index("step 12: 1 sample, mean score 1<") < dom.index("step 8: 20 samples, mean score 0.5<")
            < dom.index("step 4: 1 sample, mean score 0<"))
    assert "Compute 7*6 &lt;&amp;escaped&gt;" in dom and "The answer is 42" in dom
    head = re.search(r"step 12: .*?</tr>", dom, re.S).group(0)
    assert re.findall(r"<th>([^<]+)</th>", head) == ["#", "prompt", "response", "score", "ground_truth", "acc",
                                                     "data_source", "response_length"]
    assert "a training prompt" not in dom
    assert "What is 3+3? &lt;verl prompt&gt;" in dom and "4 more samples of step 8" in dom
    # the summary, the image and the config
    assert "best val/arithmetic/mean@1 (step 12)" in dom and "last step" in dom
    assert "images/val_step_12.png" in dom and "data:image/png;base64," in dom
    assert "adv_estimator: grpo" in dom and "polyrl-engine-fsdp==0.1.0" in dom
    # what a person sees: the curves' colour and the embedded image's colour are on the screen
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 4200)
    pixels = np.asarray(img, dtype=np.int16)

    def near(rgb: tuple[int, int, int]) -> int:
        return int((np.abs(pixels - np.array(rgb)) <= 12).all(-1).sum())

    assert near(CURVE_RGB) > 1500, "the curves are not visible in the screenshot"
    assert near(GRID_RGB) > 20_000, "the image grid is not visible in the screenshot"


def test_long_runs_are_thinned_and_the_last_point_kept(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "critic/score/mean": s / 5000})
                                               + "\n" for s in range(1, 5001)))
    page = render_report(run)
    points = re.search(r'<polyline[^>]*points="([^"]+)"', page).group(1).split()
    assert len(points) == MAX_POINTS
    assert "(1)" in page  # the legend's last value: step 5000's
    assert len(page) < 200_000


def test_view_bad_input_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["view", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"polyrl view: error: {empty} has no metrics.jsonl: not a polyrl run directory, or a "
                                "run whose trainer.logger leaves out jsonl (add it: trainer.logger=[console,jsonl])"]
    (empty / "metrics.jsonl").write_text("")
    assert main(["view", str(empty)]) == 2
    assert "holds no metrics yet" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such run directory" in err
    assert not (empty / "report.html").exists()


def test_write_report_replaces_the_file_atomically(run_dir):
    out = write_report(run_dir, live=True)
    first = out.read_text()
    out2 = write_report(run_dir)
    assert out2 == out and out.read_text() != first
    assert not list(run_dir.glob(".*.tmp"))


def test_generations_from_the_configured_folder(tmp_path):
    from polyrl.report import generation_files

    run = tmp_path / "run"
    (run / "dumps").mkdir(parents=True)
    (run / "dumps" / "3.jsonl").write_text(json.dumps({"prompt": "p", "response": "r", "score": 0.5}) + "\n")
    (run / "config.yaml").write_text("trainer:\n  validation_data_dir: dumps\n")
    assert generation_files(run) == [run / "dumps" / "3.jsonl"]
    assert read_generations(run) == {3: [{"prompt": "p", "response": "r", "score": 0.5}]}
    (run / "config.yaml").write_text("trainer:\n  validation_data_dir: ''\n")
    assert generation_files(run) == []
    (run / "config.yaml").write_text("trainer:\n  validation_data_dir: auto\n")
    (run / "generations" / "validation").mkdir(parents=True)
    (run / "generations" / "validation" / "5.jsonl").write_text(json.dumps({"step": 5, "prompt": "q"}) + "\n")
    assert list(read_generations(run)) == [5]


# ---------------------------------------------------------------------- bounded whatever the data (issue 47)

_any_float = st.floats(allow_nan=True, allow_infinity=True)


def _bounded(fn, *, extra_bytes: int = 1 << 30, timeout: float = 100.0) -> None:
    """Run ``fn`` (a hypothesis test) in a forked child whose address space may grow by ``extra_bytes`` at most, so
    that a loop that never ends (the old tick code's, issue 47) fails the test with a MemoryError or the timeout
    instead of taking the machine. The child's output (a falsifying example) goes where the test's does."""
    import multiprocessing
    import resource

    def target() -> None:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, resource.RLIM_INFINITY))
        fn()

    child = multiprocessing.get_context("fork").Process(target=target)
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{fn.__name__} did not finish within {timeout:.0f} s")
    assert child.exitcode == 0, f"{fn.__name__} failed (exit code {child.exitcode}; its output is above)"


@settings(max_examples=400, deadline=None)  # the child's time limit bounds the whole run (no per-example flake)
@given(lo=_any_float, hi=_any_float, count=st.integers(0, 12))
def _ticks_are_few_ordered_and_inside_the_range(lo, hi, count):
    ticks = axis_ticks(lo, hi, count)
    assert len(ticks) <= 3 * max(2, count) + 1
    assert all(np.isfinite(ticks)) and ticks == sorted(set(ticks))
    if ticks:
        tol = 1e-6 * max(abs(lo), abs(hi))
        assert lo - tol <= ticks[0] and ticks[-1] <= hi + tol


@pytest.mark.timeout(120)
def test_ticks_are_few_ordered_and_inside_the_range_for_any_floats():
    _bounded(_ticks_are_few_ordered_and_inside_the_range)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=50),
       first_step=st.integers(-(2**53), 2**53 - 100))
def _panel_is_small_and_drawable(values, first_step):
    lo, hi = axis_limits(min(values), max(values))
    assert np.isfinite([lo, hi]).all() and lo < hi and lo <= min(values) and max(values) <= hi
    svg = svg_panel("p", {"m": [(float(first_step + i), v) for i, v in enumerate(values)]})
    coords = [float(c) for c in re.findall(r'(?:cx|cy|x1|x2|y1|y2)="(-?[\d.]+|[^"]*)"', svg)]
    assert coords and all(-1 <= c <= 430 for c in coords), "a point is drawn outside the chart"
    assert len(svg) < 40_000


@pytest.mark.timeout(120)
def test_a_panel_of_any_finite_values_is_small_and_drawable():
    _bounded(_panel_is_small_and_drawable)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries({"step": st.integers(-5, 10**20)}, optional={
    "actor/lr": st.one_of(_any_float, st.integers(-(10**400), 10**400), st.booleans(), st.text(max_size=3),
                          st.none()),
    "critic/score/mean": _any_float, "val/x/mean@1": st.sampled_from([0.0001, 9.999999999999999e-05, 1e-300])}),
    min_size=1, max_size=30))
def _any_metrics_file_renders(rows):
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "cut')
        try:
            page = render_report(run)
        except DataError as exc:  # no row with a usable step
            assert "no metrics yet" in str(exc)
            return
        assert page.endswith("</html>\n") and len(page) < 200_000


@pytest.mark.timeout(120)
def test_any_metrics_file_renders_in_bounded_time():
    _bounded(_any_metrics_file_renders)


def test_a_one_ulp_range_is_drawn_at_once(tmp_path):
    """A resumed run's constant lr, logged as 0.0001 and then 9.999999999999999e-05 (issue 47): the old tick loop
    never advanced over the one-ulp span and grew until the kernel killed the process. Run in a child with a memory
    and a time limit, so that a regression fails here instead of taking the machine."""
    run = tmp_path / "resumed"
    run.mkdir()
    rows = [{"step": s, "actor/lr": 0.0001 if s <= 3 else 9.999999999999999e-05} for s in range(1, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from polyrl.report import write_report; print(write_report(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    page = (run / "report.html").read_text()
    panel = page[page.index("<h3>actor/lr</h3>"):]
    ticks = re.findall(r'text-anchor="end" fill="#57606a">([^<]+)</text>', panel[:panel.index("</svg>")])
    assert 2 <= len(ticks) <= 15 and "0.0001" in page, ticks


def test_a_long_run_is_read_in_bounded_memory_and_incrementally(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    n = 3 * MAX_KEPT
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, n + 1):
            f.write(json.dumps({"step": s, "critic/score/mean": s / n, "timing/step": 2.0, "x": float("nan")}) + "\n")
    reader = MetricsReader(run)
    series = reader.read()
    score = series["critic/score/mean"]
    assert len(score.points) <= MAX_KEPT and score.last == (n, 1.0) and score.best == (n, 1.0)
    assert series["timing/step"].mean() == 2.0 and series["timing/step"].total == 2.0 * n
    assert "x" not in series  # never finite
    curve = score.curve()
    assert curve[-1] == (float(n), 1.0) and [p[0] for p in curve] == sorted(p[0] for p in curve)
    # the next read takes only the new lines; a step logged again (a resume) replaces the old value
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": n, "timing/step": 4.0}) + "\n" + '{"step": ')
    offset = reader.offset
    reader.read()
    assert reader.offset > offset and series["timing/step"].total == 2.0 * n + 2.0  # n is kept: replaced
    page = render_report(run, metrics=reader)
    assert f"<b>{n}</b><span>last step</span>" in page and "training time" in page


def test_a_report_that_cannot_be_written_is_one_warning(run_dir, caplog):
    (run_dir / "report.html").mkdir()  # where the page goes is a folder: every write fails
    writer = ReportWriter(run_dir)
    with caplog.at_level("WARNING", logger="polyrl"):
        assert [writer.write(live=True) for _ in range(5)] + [writer.write(live=False)] == [None] * 6
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "report.html" in warnings[0].getMessage() and "polyrl view" in warnings[0].getMessage()


def test_generation_files_are_read_in_bounded_amounts(tmp_path):
    from polyrl.report import MAX_GEN_FILES, MAX_LINE

    run = tmp_path / "many-validations"
    val = run / "val_generations"
    val.mkdir(parents=True)
    for step in range(MAX_GEN_FILES + 50):
        (val / f"{step}.jsonl").write_text(json.dumps({"prompt": "p", "response": "r", "score": 1.0}) + "\n")
    # a line too long to show (a response of 2 MiB), then a good one
    (val / f"{MAX_GEN_FILES + 49}.jsonl").write_text(json.dumps({"prompt": "x", "response": "y" * (2 * MAX_LINE)})
                                                     + "\n" + json.dumps({"prompt": "kept", "score": 0.5}) + "\n")
    gens = read_generations(run)
    assert sorted(gens) == list(range(50, MAX_GEN_FILES + 50))  # the newest steps' files
    assert [s["prompt"] for s in gens[MAX_GEN_FILES + 49]] == ["kept"]
