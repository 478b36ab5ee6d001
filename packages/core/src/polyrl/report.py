"""``polyrl view RUN_DIR``: one self-contained HTML page about a run.

The page (``RUN_DIR/report.html``) holds the curves of ``metrics.jsonl`` drawn as inline SVG, the
validation generations per step with their scores, the run's PNG images (diffusion grids) embedded as
data URIs, and the resolved config, manifest and platform. It loads nothing from the network: no
script, no font, no stylesheet from elsewhere; it opens from a laptop's disk, a shared drive or an
e-mail attachment. The trainer rewrites it after each validation and every ``trainer.report_freq``
steps (about 0.15 s for 1000 steps of 45 metrics).

Validation generations are read from JSONL files, one row per sample (docs/view.md):
``step`` (or a step number in the file name, ``12.jsonl``), ``prompt`` (or verl's ``input``),
``response`` (or ``output``), ``score`` (or ``reward``); other scalar keys (ground truth, accuracy,
reward extras) are shown as extra columns. They are looked for in ``trainer.validation_data_dir``
when the run's config has one (``auto``: ``RUN_DIR/generations/validation``), and in folders under the
run directory whose name has ``val`` in it; rows marked ``"kind": "train"`` are left out.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from polyrl.errors import DataError

#: The file the trainer and ``polyrl view`` write in the run directory.
REPORT_FILE = "report.html"

#: Curve panels, in page order: title and metric keys (a ``*`` matches any middle part).
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["critic/score/mean", "critic/rewards/mean"]),
    ("validation", ["val/*mean@1", "val/*pass@*", "val/*mean@*"]),
    ("accuracy", ["acc/mean"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("KL", ["actor/ppo_kl", "actor/kl_ref", "actor/kl_loss"]),
    ("policy loss", ["actor/pg_loss", "sft/loss"]),
    ("entropy", ["actor/entropy", "actor/entropy_rollout"]),
    ("grad norm", ["actor/grad_norm"]),
    ("time per phase (s)", ["timing/*"]),
    ("throughput (tokens/s)", ["throughput/tokens_per_s", "throughput/gen_tokens_per_s"]),
]
#: Colours of a panel's lines (matplotlib's tab10, so the page matches ``polyrl plot``).
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
#: Most points drawn per line (longer runs are thinned evenly; the last point is always kept).
MAX_POINTS = 400
#: Validation steps shown (newest first), rows shown per step, characters shown per text.
MAX_GEN_STEPS = 20
MAX_GEN_ROWS = 16
MAX_TEXT = 2000
#: Images embedded (newest first); older ones, and larger ones, are listed by path.
MAX_IMAGES = 12
MAX_IMAGE_BYTES = 4 << 20
#: Folders of a run directory that hold no report material.
_SKIP_DIRS = {"checkpoints", "ray", "tensorboard", "wandb", "mlruns", "mlflow", "profile", "hf", ".polyrl"}


def write_report(run_dir: str | Path, out: str | Path | None = None, *, live: bool = False,
                 metrics: MetricsReader | None = None) -> Path:
    """Write the run's HTML report (default ``RUN_DIR/report.html``) and return its path.

    ``live=True`` marks the page as written during a run: it reloads itself every 30 seconds in a
    browser. ``metrics`` (a :class:`MetricsReader` of this run kept between calls) reads only the lines
    written since the last call. Raises :class:`~polyrl.errors.DataError` when ``run_dir`` is not a run
    directory or has no metrics yet. The file is replaced atomically, so a browser never reads half a page.
    """
    run = Path(run_dir)
    page = render_report(run, live=live, metrics=metrics)
    target = Path(out) if out else run / REPORT_FILE
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)
    return target


def render_report(run_dir: str | Path, *, live: bool = False, metrics: MetricsReader | None = None) -> str:
    """The report page of ``run_dir`` as one HTML string (see :func:`write_report`)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise DataError(f"{run}: no such run directory (polyrl view takes the trainer.run_dir of a run)")
    reader = metrics or MetricsReader(run)
    series = reader.read()
    config_text = _read_text(run / "config.yaml")
    generations = read_generations(run, config_text)
    images = find_images(run)
    parts = [_head(run, live), _summary(run, reader, live), _curves(series), _generations(generations),
             _images(run, images), _files(run, config_text), "</main></body></html>\n"]
    return "".join(parts)


class ReportWriter:
    """The trainer's report: rewritten during the run and at its end, never at the run's cost.

    It keeps a :class:`MetricsReader`, so each rewrite reads only the new lines of ``metrics.jsonl``; a
    failure to write is one warning, after which the run goes on without a report (``polyrl view RUN_DIR``
    writes it afterwards).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = MetricsReader(self.run_dir)
        self.failed = False

    def write(self, *, live: bool) -> Path | None:
        """Write ``RUN_DIR/report.html``; None when it failed (now, or earlier in the run)."""
        if self.failed:
            return None
        try:
            return write_report(self.run_dir, live=live, metrics=self.metrics)
        except Exception as exc:  # the report is a view of the run: the run goes on without it
            self.failed = True
            logging.getLogger("polyrl").warning(
                "could not write %s (%s: %s); the run goes on without it (polyrl view %s writes it later)",
                self.run_dir / REPORT_FILE, type(exc).__name__, exc, self.run_dir)
            return None


# ---------------------------------------------------------------------- reading the run directory


#: Points kept per metric while reading (evenly spaced in steps; the last one always kept). Bounds the memory
#: and time of a report whatever the length of the run.
MAX_KEPT = 4096
#: Longest ``metrics.jsonl`` line read (a longer one is skipped).
MAX_LINE = 1 << 20
#: Steps outside this range are not a step counter (and do not fit a float): their lines are skipped.
MAX_STEP = 1 << 53


class Series:
    """One metric's points, at most :data:`MAX_KEPT` of them: those whose step is a multiple of ``stride``
    (doubled when full), plus the last, best and running total of every value seen."""

    __slots__ = ("best", "count", "last", "points", "stride", "total")

    def __init__(self) -> None:
        self.points: dict[int, float] = {}
        self.stride = 1
        self.last: tuple[int, float] | None = None
        self.best: tuple[int, float] | None = None
        self.total = 0.0
        self.count = 0

    def add(self, step: int, value: float) -> None:
        """Record ``value`` at ``step`` (a later value for the same step replaces the earlier one)."""
        if step % self.stride == 0:
            old = self.points.get(step)
            if old is not None:  # a resumed run logs the steps after its checkpoint again: the later wins
                self.total -= old
                self.count -= 1
            self.points[step] = value
            if len(self.points) > MAX_KEPT:
                self.stride *= 2
                self.points = {s: v for s, v in self.points.items() if s % self.stride == 0}
        last, best = self.last, self.best
        if last is None or step >= last[0]:
            self.last = (step, value)
        if best is None or value > best[1]:
            self.best = (step, value)
        self.total += value
        self.count += 1

    def curve(self) -> list[tuple[float, float]]:
        """The kept points in step order (the last one included), as floats."""
        points = dict(self.points)
        if self.last is not None:
            points[self.last[0]] = self.last[1]
        return [(float(s), points[s]) for s in sorted(points)]

    def mean(self) -> float:
        """The mean of the values seen."""
        return self.total / max(1, self.count)


class MetricsReader:
    """Reads ``RUN_DIR/metrics.jsonl`` into one :class:`Series` per metric, in bounded memory.

    Each :meth:`read` goes on from where the last one stopped (a line still being written is read next
    time); a file that shrank (rewritten) is read again from its start.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run = Path(run_dir)
        self.path = self.run / "metrics.jsonl"
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.series: dict[str, Series] = {}
        self.steps = Series()  # the step numbers themselves: first/last step

    def read(self) -> dict[str, Series]:
        """Every metric's series so far (``DataError`` when the run has none)."""
        if not self.path.exists():
            raise DataError(f"{self.run} has no metrics.jsonl: not a polyrl run directory, or a run whose "
                            "trainer.logger leaves out jsonl (add it: trainer.logger=[console,jsonl])")
        if self.path.stat().st_size < self.offset:
            self._reset()
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while True:
                line = f.readline(MAX_LINE)
                if not line.endswith(b"\n"):
                    if len(line) < MAX_LINE:  # the end of the file, maybe in a line being written
                        break
                    while line and not line.endswith(b"\n"):  # a line too long to be metrics: skip it
                        line = f.readline(MAX_LINE)
                    self.offset = f.tell()
                    continue
                self.offset = f.tell()
                self._add(line)
        if self.steps.last is None:
            raise DataError(f"{self.path} holds no metrics yet: the run has not logged a step")
        return self.series

    def _add(self, line: bytes) -> None:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a crash: the rest is still good
            return
        if not isinstance(row, dict):
            return
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not -MAX_STEP <= step <= MAX_STEP:
            return
        self.steps.add(step, float(step))
        series = self.series
        for key, value in row.items():  # the hot loop of a long run's report: plain type tests, no calls
            kind = type(value)
            if kind is float:
                if value - value != 0.0:  # nan or inf
                    continue
            elif kind is int and -1e308 <= value <= 1e308:
                value = float(value)
            else:
                continue
            if key == "step" or key == "time":
                continue
            found = series.get(key)
            if found is None:
                found = series[key] = Series()
            found.add(step, value)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _configured_generation_dirs(run: Path, config_text: str | None) -> list[Path]:
    """``trainer.validation_data_dir`` from the run's config, as given and relative to the run directory."""
    if not config_text:
        return []
    match = re.search(r"^\s+validation_data_dir:\s*(.+?)\s*$", config_text, re.M)
    if not match or match.group(1) in ("null", "''", '""', "~"):
        return []
    if match.group(1).strip("'\"") == "auto":
        return [run / "generations" / "validation"]
    value = Path(match.group(1).strip("'\""))
    return [value] if value.is_absolute() else [run / value, value]


def generation_files(run_dir: str | Path, config_text: str | None = None) -> list[Path]:
    """The JSONL files of validation generations of a run (see the module docstring)."""
    run = Path(run_dir)
    if config_text is None:
        config_text = _read_text(run / "config.yaml")
    found: dict[Path, None] = {}
    for folder in _configured_generation_dirs(run, config_text):
        if folder.is_dir():
            found.update((p, None) for p in sorted(folder.glob("*.jsonl")))
    for path in sorted(_walk(run, suffix=".jsonl")):
        rel = path.relative_to(run).parts[:-1]
        if any("val" in part.lower() for part in rel):
            found[path] = None
    return list(found)


#: Bytes read of one validation-generations file, and such files read (those of the newest steps first).
MAX_GEN_FILE_BYTES = 64 << 20
MAX_GEN_FILES = 200


def read_generations(run_dir: str | Path, config_text: str | None = None) -> dict[int, list[dict[str, Any]]]:
    """Validation samples per step: ``{step: [{"prompt", "response", "score", ...extras}]}``.

    Tolerates verl's key names (``input``, ``output``) and rows without a ``step`` when the file name is
    the step (``12.jsonl``); unreadable lines are skipped. Bounded: the first :data:`MAX_GEN_FILE_BYTES` of each
    of at most :data:`MAX_GEN_FILES` files (the highest step numbers in their names), lines under
    :data:`MAX_LINE`.
    """
    def file_step(path: Path) -> int | None:
        digits = re.findall(r"\d+", path.stem)
        return int(digits[-1]) if digits else None

    files = generation_files(run_dir, config_text)
    if len(files) > MAX_GEN_FILES:
        files = sorted(files, key=lambda p: (file_step(p) is not None, file_step(p) or 0), reverse=True)
        files = files[:MAX_GEN_FILES]
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for path in files:
        named_step = file_step(path)
        try:
            lines = _bounded_lines(path, MAX_GEN_FILE_BYTES)
        except OSError:
            continue
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step", named_step)
            if not isinstance(step, int) or row.get("kind", "validation") == "train":
                continue
            steps[step].append(_sample(row))
    return dict(steps)


def _bounded_lines(path: Path, budget: int) -> list[str]:
    """The complete lines in the first ``budget`` bytes of ``path``, each under :data:`MAX_LINE` (longer ones
    skipped)."""
    out: list[str] = []
    with open(path, "rb") as f:
        while budget > 0:
            line = f.readline(min(MAX_LINE, budget))
            if not line:
                break
            budget -= len(line)
            if line.endswith(b"\n") or len(line) < MAX_LINE:
                out.append(line.decode("utf-8", errors="replace"))
            else:  # a line too long to show: skip the rest of it
                while line and not line.endswith(b"\n") and budget > 0:
                    line = f.readline(min(MAX_LINE, budget))
                    budget -= len(line)
    return out


def _sample(row: dict[str, Any]) -> dict[str, Any]:
    def first(*keys: str) -> Any:
        return next((row[k] for k in keys if k in row), None)

    out = {"prompt": first("prompt", "input", "prompts"), "response": first("response", "output", "responses"),
           "score": first("score", "reward", "scores")}
    used = {"prompt", "input", "prompts", "response", "output", "responses", "score", "scores", "step"}
    out.update({k: v for k, v in row.items() if k not in used and isinstance(v, (str, int, float, bool))})
    extra = row.get("reward_extra")  # the reward function's other outputs (acc, format...)
    if isinstance(extra, dict):
        out.update({k: v for k, v in extra.items() if k not in out and isinstance(v, (str, int, float, bool))})
    return out


#: Extra columns of the generations table, most useful first (then the rest in file order), and fields left out.
_EXTRA_ORDER = ("ground_truth", "gts", "acc", "data_source", "response_length", "advantage", "sample_id")
_EXTRA_HIDDEN = {"uid", "kind", "reward", "turns"}


def _extra_columns(samples: list[dict[str, Any]], count: int = 4) -> list[str]:
    seen = list(dict.fromkeys(k for s in samples for k in s if k not in ("prompt", "response", "score")))
    seen = [k for k in seen if k not in _EXTRA_HIDDEN]
    rank = {k: i for i, k in enumerate(_EXTRA_ORDER)}
    return sorted(seen, key=lambda k: (rank.get(k, len(rank)), seen.index(k)))[:count]


def find_images(run_dir: str | Path) -> list[Path]:
    """The PNG images of a run (diffusion grids and the like), oldest step first; ``curves.png`` excluded."""
    run = Path(run_dir)
    images = [p for p in _walk(run, suffix=".png") if p != run / "curves.png"]
    return sorted(images, key=lambda p: (_step_of(p), str(p)))


def _step_of(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem) or re.findall(r"\d+", path.parent.name)
    return int(digits[-1]) if digits else -1


def _walk(run: Path, *, suffix: str, depth: int = 4) -> Iterable[Path]:
    """Files with ``suffix`` under ``run``, not in the folders of :data:`_SKIP_DIRS`, at most ``depth`` deep."""
    stack = [(run, 0)]
    while stack:
        folder, level = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if level + 1 < depth and entry.name not in _SKIP_DIRS and not entry.name.startswith("."):
                    stack.append((Path(entry.path), level + 1))
            elif entry.name.endswith(suffix) and entry.name != "metrics.jsonl" and not entry.name.startswith("."):
                yield Path(entry.path)


# ---------------------------------------------------------------------- page parts

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#222;background:#f6f7f9}
header{background:#24292f;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .sub{color:#c9d1d9;font-size:13px}main{padding:8px 24px 40px}
h2{font-size:17px;margin:26px 0 10px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.facts{display:flex;flex-wrap:wrap;gap:10px}.fact{background:#fff;border:1px solid #d0d7de;border-radius:6px;
padding:8px 12px;min-width:120px}.fact b{display:block;font-size:18px}.fact span{color:#57606a;font-size:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(430px,1fr));gap:12px}
.panel{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px}
.panel h3{margin:0 0 4px;font-size:14px}.legend{font-size:12px;color:#444}.legend>span{display:inline-block;white-space:nowrap;margin-right:6px}
.legend i{display:inline-block;width:10px;height:10px;margin:0 4px 0 8px;border-radius:2px}
table{border-collapse:collapse;background:#fff;width:100%;font-size:13px}
td,th{border:1px solid #d0d7de;padding:4px 6px;vertical-align:top;text-align:left}th{background:#f0f2f4}
td.num{text-align:right;white-space:nowrap}pre{margin:0;white-space:pre-wrap;word-break:break-word;
font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
.files pre{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px;max-height:600px;overflow:auto}
figure{margin:0;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px}
figure img{width:100%;image-rendering:pixelated}figcaption{font-size:12px;color:#57606a}
.muted{color:#57606a}.good{color:#1a7f37}.bad{color:#cf222e}
"""


def _head(run: Path, live: bool) -> str:
    refresh = '<meta http-equiv="refresh" content="30">' if live else ""
    title = html.escape(f"polyrl run {run.resolve().name}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{refresh}'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{title}</title>'
            f"<style>{_STYLE}</style></head><body>")


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return html.escape(str(value))
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}"


def _summary(run: Path, reader: MetricsReader, live: bool) -> str:
    series = reader.series
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    status = "running: this page reloads every 30 s" if live else "written by polyrl"
    header = (f"<header><h1>{html.escape(run.resolve().name)}</h1><div class=sub>{html.escape(str(run.resolve()))}"
              f" &middot; {status} &middot; {when}</div></header><main>")
    last_step = reader.steps.last[0] if reader.steps.last is not None else "none"
    facts: list[tuple[str, str]] = [("last step", str(last_step))]
    for key, label in (("critic/score/mean", "score (last step)"), ("acc/mean", "accuracy (last step)")):
        found = series.get(key)
        if found is not None and found.last is not None:
            facts.append((label, _fmt(found.last[1])))
    val_keys = sorted(k for k in series if k.startswith("val/") and k.endswith("mean@1"))
    for key in val_keys[:3]:
        best, last = series[key].best, series[key].last
        if best is not None and last is not None:
            facts.append((f"best {key} (step {best[0]})", _fmt(best[1])))
            facts.append((f"last {key} (step {last[0]})", _fmt(last[1])))
    step_time = series.get("timing/step")
    if step_time is not None and step_time.count:
        facts.append(("mean step time", f"{step_time.mean():.3g} s"))
        facts.append(("training time", f"{step_time.total:.4g} s"))
    ckpts = sorted((run / "checkpoints").glob("step_*"), key=_step_of) if (run / "checkpoints").is_dir() else []
    if ckpts:
        facts.append(("last checkpoint", ckpts[-1].name))
    body = "".join(f"<div class=fact><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>" for k, v in facts)
    return f"{header}<h2>Summary</h2><div class=facts>{body}</div>"


def _finite(value: Any) -> bool:
    """A real number a float holds (JSON's integers have no bound; booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return abs(value) <= 1e308
    return math.isfinite(value)


def _match(pattern: str, keys: Sequence[str]) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in keys else []
    regex = re.compile("^" + ".*".join(re.escape(p) for p in pattern.split("*")) + "$")
    return sorted(k for k in keys if regex.match(k))


#: Most panels drawn under "every other metric" (a run logging thousands of keys lists the rest by name).
MAX_OTHER_PANELS = 200


def _curves(series: dict[str, Series]) -> str:
    keys = sorted(series)
    used: set[str] = set()
    panels = []
    for title, patterns in PANELS:
        ks = [k for p in patterns for k in _match(p, keys) if k not in used]
        ks = list(dict.fromkeys(ks))
        if ks:
            used.update(ks)
            panels.append(svg_panel(title, {k: series[k].curve() for k in ks}))
    rest = [k for k in keys if k not in used]
    out = ["<h2>Curves</h2>"]
    out.append(f"<div class=grid>{''.join(panels)}</div>" if panels else "<p class=muted>no curve metrics yet</p>")
    if rest:
        small = "".join(svg_panel(k, {k: series[k].curve()}, height=150) for k in rest[:MAX_OTHER_PANELS])
        unlisted = rest[MAX_OTHER_PANELS:]
        more = (f"<p class=muted>not drawn: {html.escape(', '.join(unlisted))}</p>" if unlisted else "")
        out.append(f"<details><summary>every other metric ({len(rest)})</summary><div class=grid>{small}</div>"
                   f"{more}</details>")
    return "".join(out)


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = len(points) / (MAX_POINTS - 1)
    return [points[int(i * stride)] for i in range(MAX_POINTS - 1)] + [points[-1]]


#: Largest finite float; axis limits are clamped to it.
_FLOAT_MAX = sys.float_info.max


def axis_limits(lo: float, hi: float) -> tuple[float, float]:
    """Axis limits for data in ``[lo, hi]``: a margin around it, and a visible width when the data is constant or
    its range is below what a float resolves at its magnitude (``1e-4`` against ``1e-4`` less one ulp)."""
    scale = max(abs(lo), abs(hi))
    if hi - lo <= scale * 1e-9:  # constant, or a range of a few ulps: centre it
        mid = lo / 2 + hi / 2
        pad = abs(mid) * 0.1 or 1.0
        lo, hi = mid - pad, mid + pad
    else:
        pad = (hi / 2 - lo / 2) * 0.12  # halves: hi - lo overflows for data near the float range's ends
        lo, hi = lo - pad, hi + pad
    return max(lo, -_FLOAT_MAX), min(hi, _FLOAT_MAX)


def axis_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers in ``[lo, hi]``; at most ``3 * count`` whatever the input (none for a
    range that is not finite and ordered, the two ends for one too narrow or wide for round steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return []
    if hi == lo:
        return [lo]
    count = max(2, count)
    raw = hi / (count - 1) - lo / (count - 1)  # the span over (count - 1), without hi - lo overflowing
    if not raw > 0 or not math.isfinite(raw):
        return [lo, hi]
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), 0.0)
    if not 0 < step < math.inf:
        return [lo, hi]
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    if not 0 <= last - first <= 3 * count:  # steps below the floats' resolution at this magnitude
        return [lo, hi]
    out: list[float] = []
    for k in range(first, last + 1):
        value = k * step
        if math.isfinite(value) and (not out or value > out[-1]):
            out.append(value)
    return out or [lo, hi]


def svg_panel(title: str, series: dict[str, list[tuple[float, float]]], *, width: int = 430, height: int = 210) -> str:
    """One chart: an inline SVG with axes, ticks, one polyline per series, and a legend below."""
    left, right, top, bottom = 56, 12, 8, 26
    series = {name: _thin(points) for name, points in series.items() if points}
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = axis_limits(min(p[1] for p in pts), max(p[1] for p in pts))
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    y_span = (y1 / 2 - y0 / 2) or 1.0  # in halves, so that no difference overflows

    def sy(y: float) -> float:
        return top + (1 - (y / 2 - y0 / 2) / y_span) * plot_h

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{html.escape(title)}" font-size="10" font-family="system-ui,sans-serif">',
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#d0d7de"/>']
    for t in axis_ticks(y0, y1):
        y = sy(t)
        svg.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeef2"/>'
                   f'<text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" fill="#57606a">{_fmt(t)}</text>')
    xt = [t for t in axis_ticks(x0, x1) if float(t).is_integer()] or [x0, x1]
    for t in xt:
        x = sx(t)
        svg.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#f3f4f6"/>'
                   f'<text x="{x:.1f}" y="{height - 12}" text-anchor="middle" fill="#57606a">{int(t)}</text>')
    svg.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 1}" text-anchor="middle" fill="#57606a">step</text>')
    legend = []
    for i, (name, shown) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in shown)
        if len(shown) > 1:
            svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{coords}"/>')
        if len(shown) <= 60:  # markers with the value on hover
            for x, y in shown:
                svg.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.6" fill="{color}">'
                           f"<title>{html.escape(name)} @ step {int(x)}: {_fmt(y)}</title></circle>")
        last = shown[-1][1]
        legend.append(f'<span><i style="background:{color}"></i>{html.escape(name)} '
                      f"<span class=muted>({_fmt(last)})</span></span>")
    svg.append("</svg>")
    return (f"<div class=panel><h3>{html.escape(title)}</h3>{''.join(svg)}"
            f"<div class=legend>{''.join(legend)}</div></div>")


def _clip(value: Any) -> str:
    if isinstance(value, (list, dict)):
        value = json.dumps(value, ensure_ascii=False)
    text = "" if value is None else str(value)
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + f" ... ({len(text) - MAX_TEXT} more characters)"
    return html.escape(text)


def _generations(generations: dict[int, list[dict[str, Any]]]) -> str:
    out = ["<h2>Validation generations</h2>"]
    if not generations:
        out.append("<p class=muted>none recorded (validation samples are kept as JSONL per step: docs/view.md)</p>")
        return "".join(out)
    steps = sorted(generations, reverse=True)
    for n, step in enumerate(steps[:MAX_GEN_STEPS]):
        samples = generations[step]
        scores = [float(s["score"]) for s in samples if _finite(s.get("score"))]
        mean = f", mean score {_fmt(sum(scores) / len(scores))}" if scores else ""
        count = f"{len(samples)} sample" + ("s" if len(samples) != 1 else "")
        extras = _extra_columns(samples)
        head = "".join(f"<th>{html.escape(k)}</th>" for k in ["#", "prompt", "response", "score", *extras])
        body = []
        for i, s in enumerate(samples[:MAX_GEN_ROWS]):
            score = s.get("score")
            cls = "num good" if _finite(score) and score is not None and score > 0 else "num"
            cells = [f"<td class=num>{i + 1}</td>", f"<td><pre>{_clip(s.get('prompt'))}</pre></td>",
                     f"<td><pre>{_clip(s.get('response'))}</pre></td>", f"<td class='{cls}'>{_fmt(score)}</td>"]
            cells += [f"<td>{_clip(s.get(k))}</td>" for k in extras]
            body.append(f"<tr>{''.join(cells)}</tr>")
        more = (f"<p class=muted>{len(samples) - MAX_GEN_ROWS} more samples of step {step} in the JSONL file</p>"
                if len(samples) > MAX_GEN_ROWS else "")
        opened = " open" if n == 0 else ""
        out.append(f"<details{opened}><summary>step {step}: {count}{mean}</summary>"
                   f"<table><tr>{head}</tr>{''.join(body)}</table>{more}</details>")
    if len(steps) > MAX_GEN_STEPS:
        out.append(f"<p class=muted>{len(steps) - MAX_GEN_STEPS} older validation steps not shown</p>")
    return "".join(out)


def _images(run: Path, images: list[Path]) -> str:
    if not images:
        return ""
    shown = list(reversed(images))[:MAX_IMAGES]
    figs = []
    for path in shown:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size > MAX_IMAGE_BYTES:
            figs.append(f"<figure><figcaption>{html.escape(str(path.relative_to(run)))} ({size >> 20} MiB: not "
                        "embedded)</figcaption></figure>")
            continue
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        rel = html.escape(str(path.relative_to(run)))
        figs.append(f'<figure><img alt="{rel}" src="data:image/png;base64,{data}"><figcaption>{rel}</figcaption></figure>')
    older = images[: len(images) - len(shown)]
    listed = ("<p class=muted>older images: " + ", ".join(html.escape(str(p.relative_to(run))) for p in older) + "</p>"
              if older else "")
    return f"<h2>Images</h2><div class=grid>{''.join(figs)}</div>{listed}"


def _files(run: Path, config_text: str | None) -> str:
    out = ["<h2>Run files</h2><div class=files>"]
    for name, text in (("config.yaml", config_text), ("manifest.lock.toml", _read_text(run / "manifest.lock.toml")),
                       ("platform.json", _read_text(run / "platform.json"))):
        if text is not None:
            out.append(f"<details{' open' if name == 'config.yaml' else ''}><summary>{name}</summary>"
                       f"<pre>{html.escape(text)}</pre></details>")
    out.append("</div>")
    return "".join(out)
