"""Profiling: torch.profiler traces of chosen training steps, and ``polyrl profile RUN_DIR``.

With ``trainer.profile.steps=[3,7]`` every worker process records steps 3 and 7 with
``torch.profiler`` (:class:`ProfileRecorder`, started and stopped by the trainer through the worker
groups) and writes one Chrome trace per process::

    RUN_DIR/profile/step_3/actor-ref-rollout_rank0.pt.trace.json

The file name is the worker's roles and rank; ``.pt.trace.json`` is the name TensorBoard's profiler
plugin looks for (``tensorboard --logdir RUN_DIR/profile``), and ``chrome://tracing`` or Perfetto open
the file as it is. Each trace has a ``polyrl step N`` range around the step and a ``polyrl/<role>/<method>``
range around each call the driver made (``polyrl/rollout/generate``, ``polyrl/actor/update_actor``...).
``trainer.profile.memory=true`` adds allocation events (TensorBoard's memory view) and, on platforms
that keep an allocation history (CUDA), a memory snapshot per process
(``*.memory_snapshot.pickle``, for https://pytorch.org/memory_viz).

:func:`summarize_profile` (the ``polyrl profile`` verb) prints where a step's time went: the driver's
phases (``timing/*`` from ``metrics.jsonl``) and, per process, the roles' calls and the top operators
by self time.
"""

from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from polyrl.errors import ConfigError, DataError

#: Folder of the traces in the run directory.
PROFILE_DIR = "profile"
#: Suffix of a trace file (the TensorBoard profiler plugin's pattern).
TRACE_SUFFIX = ".pt.trace.json"
#: Prefix of the range around a whole profiled step.
STEP_RANGE = "polyrl step "
#: Prefix of the ranges around the driver's calls on a worker.
CALL_RANGE = "polyrl/"

F = TypeVar("F", bound=Callable[..., Any])
#: c10::DeviceType numbers in the trace's memory events.
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "xpu", 13: "mps", 20: "privateuse1"}


def check_profile_steps(steps: Sequence[int], total_steps: int, key: str = "trainer.profile.steps") -> list[int]:
    """The sorted distinct steps to profile; a :class:`ConfigError` for a step outside ``1..total_steps``."""
    out = sorted({int(s) for s in steps})
    bad = [s for s in out if not 1 <= s <= total_steps]
    if bad:
        raise ConfigError(f"{key}={list(steps)}: step {bad[0]} is outside this run's steps 1..{total_steps} "
                          "(trainer.total_steps, or total_epochs times the steps per epoch); profile steps in that range")
    return out


def profiled_call(role: str) -> Callable[[F], F]:
    """Decorate a worker method so a profiled step shows it as the range ``polyrl/<role>/<method>``.

    Costs one attribute look-up when the worker is not profiling.
    """

    def wrap(fn: F) -> F:
        name = f"{CALL_RANGE}{role}/{fn.__name__}"

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "_profile_recorder", None) is None:
                return fn(self, *args, **kwargs)
            import torch

            with torch.profiler.record_function(name):
                return fn(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


class ProfileRecorder:
    """One process's torch.profiler session over one step (started and stopped by the trainer).

    ``platform`` decides the activities (CPU always; the accelerator's when torch.profiler knows its
    device type) and, with ``memory``, whether an allocation history is kept
    (``platform.record_memory_history`` / ``dump_memory_snapshot``, where the platform has them).
    """

    def __init__(self, platform: Any, name: str, *, memory: bool = False, with_stack: bool = False) -> None:
        self.platform, self.name, self.memory, self.with_stack = platform, name, memory, with_stack
        self._prof: Any = None
        self._range: Any = None
        self._out: Path | None = None

    def start(self, step: int, out_dir: str | Path) -> None:
        """Start recording; everything until :meth:`stop` belongs to ``step``."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        device = getattr(ProfilerActivity, str(getattr(self.platform, "device_type", "cpu")).upper(), None)
        if device is not None and device != ProfilerActivity.CPU:
            activities.append(device)
        self._out = Path(out_dir)
        self._out.mkdir(parents=True, exist_ok=True)
        if self.memory and hasattr(self.platform, "record_memory_history"):
            self.platform.record_memory_history(True)
        self._prof = profile(activities=activities, record_shapes=self.memory, profile_memory=self.memory,
                             with_stack=self.with_stack)
        self._prof.__enter__()
        self._range = torch.profiler.record_function(f"{STEP_RANGE}{step}")
        self._range.__enter__()

    def stop(self) -> list[str]:
        """Stop recording and write the trace (and memory snapshot); returns the files written."""
        if self._prof is None or self._out is None:
            return []
        written = []
        try:
            if hasattr(self.platform, "synchronize"):
                self.platform.synchronize()
            self._range.__exit__(None, None, None)
        finally:
            self._prof.__exit__(None, None, None)
        trace = self._out / f"{self.name}{TRACE_SUFFIX}"
        self._prof.export_chrome_trace(str(trace))
        written.append(str(trace))
        if self.memory and hasattr(self.platform, "dump_memory_snapshot"):
            snapshot = self._out / f"{self.name}.memory_snapshot.pickle"
            if self.platform.dump_memory_snapshot(str(snapshot)):
                written.append(str(snapshot))
            self.platform.record_memory_history(False)
        self._prof = self._range = None
        return written


class StepProfiler:
    """The driver's side: starts and stops a :class:`ProfileRecorder` in every worker process of the
    run's groups (``Worker.start_profile`` / ``stop_profile``, through the WorkerGroup protocol)."""

    def __init__(self, groups: Sequence[Any], run_dir: Path, steps: Sequence[int], *, memory: bool = False,
                 with_stack: bool = False) -> None:
        self.groups = list(groups)
        self.run_dir = Path(run_dir)
        self.steps = set(steps)
        self.memory, self.with_stack = memory, with_stack
        self.files: list[str] = []

    def wants(self, step: int) -> bool:
        """Whether ``step`` (1-based) is one to profile."""
        return step in self.steps

    def start(self, step: int) -> None:
        """Start recording ``step`` in every process of every group."""
        out = str(self.run_dir / PROFILE_DIR / f"step_{step}")
        for group in self.groups:
            group.call_all("start_profile", step, out, memory=self.memory, with_stack=self.with_stack)

    def stop(self) -> list[str]:
        """Stop every process's recording; returns the files written."""
        written = []
        for group in self.groups:
            for files in group.call_all("stop_profile"):
                written += files or []
        self.files += written
        return written


# ---------------------------------------------------------------------- reading traces


def trace_files(run_dir: str | Path) -> dict[int, list[Path]]:
    """``{step: [trace files]}`` under ``RUN_DIR/profile``."""
    root = Path(run_dir) / PROFILE_DIR
    out: dict[int, list[Path]] = {}
    for folder in sorted(root.glob("step_*")):
        match = re.fullmatch(r"step_(\d+)", folder.name)
        files = sorted(folder.glob(f"*{TRACE_SUFFIX}"))
        if match and files:
            out[int(match.group(1))] = files
    return dict(sorted(out.items()))


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (its ``traceEvents``); a DataError naming the file if unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable Chrome trace ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise DataError(f"{path}: not a Chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict)]


def trace_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a trace says: the step range, the calls' totals, the CPU operators' self times, the device
    kernels' totals and the peak allocated memory (bytes, per device) when memory was recorded.

    Times are seconds. Self time is an operator's time less its child operators' (same thread).
    """
    steps: dict[int, float] = {}
    calls: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    peak: dict[str, float] = {}
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        if e.get("ph") == "i" and name == "[memory]":
            args = e.get("args") or {}
            kind = _DEVICE_TYPES.get(args.get("Device Type"), str(args.get("Device Type", "?")))
            index = args.get("Device Id", -1)
            device = kind if index in (-1, None) else f"{kind}:{index}"
            total = args.get("Total Allocated")
            if isinstance(total, (int, float)):
                peak[device] = max(peak.get(device, 0.0), float(total))
            continue
        if e.get("ph") != "X" or not isinstance(e.get("dur"), (int, float)):
            continue
        dur = float(e["dur"]) / 1e6
        if cat == "user_annotation" and name.startswith(STEP_RANGE):
            steps[int(name[len(STEP_RANGE):])] = dur
        elif cat == "user_annotation" and name.startswith(CALL_RANGE):
            calls[name[len(CALL_RANGE):]] += dur
        elif cat == "cpu_op":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
        elif cat == "kernel":
            kernels[name][0] += dur
            kernels[name][1] += 1
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, self time]
        for e in thread:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _, done, own = stack.pop()
                ops[done][0] += own
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
            ops[e["name"]][1] += 1
        for _, done, own in stack:
            ops[done][0] += own
    return {
        "steps": steps,
        "calls": dict(calls),
        "ops": {k: (v[0] / 1e6, int(v[1])) for k, v in ops.items()},
        "kernels": {k: (v[0], int(v[1])) for k, v in kernels.items()},
        "peak_memory": peak,
    }


def summarize_profile(run_dir: str | Path, *, step: int | None = None, top: int = 10) -> str:
    """The text ``polyrl profile RUN_DIR`` prints (see the module docstring).

    Raises :class:`~polyrl.errors.DataError` when ``run_dir`` has neither metrics nor traces, or when
    ``step`` was not profiled.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise DataError(f"{run}: no such run directory (polyrl profile takes the trainer.run_dir of a run)")
    traces = trace_files(run)
    rows = _metric_rows(run)
    if not traces and not rows:
        raise DataError(f"{run} has no metrics.jsonl and no traces in {run / PROFILE_DIR}: not a polyrl run "
                        "directory, or a run that has not finished a step")
    if step is not None and step not in traces:
        profiled = ", ".join(map(str, traces)) or "none"
        raise DataError(f"step {step} of {run} was not profiled (profiled steps: {profiled}); record it with "
                        f"trainer.profile.steps=[{step}]")
    lines = [f"polyrl profile {run}"]
    timed = [r for r in rows if any(k.startswith("timing/") for k in r)]
    if timed:
        lines += ["", f"driver phases, mean of {len(timed)} steps (timing/* in metrics.jsonl):"]
        lines += _phase_table(timed)
    chosen = [step] if step is not None else list(traces)
    if not chosen:
        lines += ["", f"no traces in {run / PROFILE_DIR}: record some with trainer.profile.steps=[N, ...] "
                  "(docs/profiling.md)"]
    by_step = {r["step"]: r for r in rows}
    for s in chosen:
        lines += ["", f"step {s}" + (f": {by_step[s]['timing/step']:.3f} s" if "timing/step" in by_step.get(s, {})
                                     else "")]
        if s in by_step:
            lines += ["  driver phases:"] + ["  " + line for line in _phase_table([by_step[s]])]
        for path in traces[s]:
            summary = trace_summary(load_trace(path))
            lines += _process_lines(path, summary, top)
    return "\n".join(lines)


def _metric_rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _phase_table(rows: list[dict[str, Any]]) -> list[str]:
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    means = {k[len("timing/"):]: sum(float(r.get(k, 0.0)) for r in rows) / len(rows) for k in keys}
    step_mean = sum(float(r.get("timing/step", 0.0)) for r in rows) / len(rows)
    total = step_mean or sum(means.values()) or 1.0
    out = [f"  {'phase':<20} {'seconds':>9} {'share':>7}"]
    for name, value in sorted(means.items(), key=lambda kv: -kv[1]):
        out.append(f"  {name:<20} {value:>9.3f} {100 * value / total:>6.1f}%")
    if step_mean:
        out.append(f"  {'step':<20} {step_mean:>9.3f} {100.0:>6.1f}%")
    return out


def _process_lines(path: Path, summary: dict[str, Any], top: int) -> list[str]:
    name = path.name[: -len(TRACE_SUFFIX)]
    span = next(iter(summary["steps"].values()), None)
    lines = [f"  process {name}" + (f" (step range {span:.3f} s)" if span is not None else "") + f": {path}"]
    if summary["calls"]:
        lines.append("    calls from the driver:")
        for call, secs in sorted(summary["calls"].items(), key=lambda kv: -kv[1]):
            lines.append(f"      {call:<34} {secs:>9.3f} s")
    ops = sorted(summary["ops"].items(), key=lambda kv: -kv[1][0])[:top]
    if ops:
        lines.append(f"    top {len(ops)} CPU operators by self time:")
        for op, (secs, count) in ops:
            lines.append(f"      {op[:48]:<48} {secs:>9.4f} s {count:>7} calls")
    kernels = sorted(summary["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
    if kernels:
        lines.append(f"    top {len(kernels)} device kernels:")
        for kernel, (secs, count) in kernels:
            lines.append(f"      {kernel[:48]:<48} {secs:>9.4f} s {count:>7} calls")
    for device, peak in sorted(summary["peak_memory"].items()):
        lines.append(f"    peak allocated on {device}: {peak / 2**20:.1f} MiB")
    return lines
