"""Metric sinks: console, jsonl, and TensorBoard / W&B / MLflow when installed and configured.

Every file a backend writes goes under the run directory (unless the user points W&B or MLflow
elsewhere through their own environment variables), and a resumed run continues the same W&B / MLflow
run: their run ids are kept in ``run_dir/wandb_run_id`` and ``run_dir/mlflow_run_id``.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import netrc
import numbers
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from polyrl.errors import ConfigError

#: The console backend's step lines (shown through :mod:`polyrl.logs`' console handler, above a progress bar).
logger = logging.getLogger("polyrl.metrics")

_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
#: What ``pip install`` brings each optional backend (also the ``polyrl[...]`` extras).
_PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
#: Shown on the console line, in this order, when present.
_CONSOLE_KEYS = (
    "critic/score/mean", "acc/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
    "timing/step", "throughput/tokens_per_s",
)
WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"
#: MLflow names may hold alphanumerics, ``_ - . /`` and spaces (``:`` too, but not on Windows).
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_MAX_KEY = 250
#: Older MLflow servers accept 500 characters per param value (newer ones 6000).
_MLFLOW_MAX_VALUE = 500


class Tracker:
    """Sends each step's metrics to every configured backend.

    ``config`` (the run's resolved config as a nested plain dict) goes to W&B as the run config, to
    MLflow as flattened params and to TensorBoard as a ``config`` text. ``resume=True`` appends to
    ``metrics.jsonl``, continues the W&B and MLflow runs whose ids are stored in ``run_dir``, and makes
    TensorBoard drop the events a crashed run wrote at or after the first step logged now.
    """

    def __init__(self, backends: list[str], run_dir: str | Path, *, project: str, experiment: str,
                 config: dict[str, Any] | None = None, resume: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.backends = list(backends)
        check_loggers(self.backends)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._config = dict(config or {})
        self._resume = resume
        self._jsonl = None
        self._tb: Any = None
        self._tb_pending = False
        self._wandb: Any = None
        self._mlflow: Any = None
        self._mlflow_run_id: str | None = None
        try:
            if "jsonl" in self.backends:
                self._jsonl = open(self.run_dir / "metrics.jsonl", "a" if resume else "w")  # noqa: SIM115
            if "tensorboard" in self.backends:
                # A resumed run opens its writer at the first step it logs, to purge the crashed run's
                # events from that step on (TensorBoard's ``purge_step``).
                self._tb_pending = True
                if not resume:
                    self._open_tensorboard(purge_step=None)
            if "wandb" in self.backends:
                self._open_wandb(project, experiment)
            if "mlflow" in self.backends:
                self._open_mlflow(project, experiment)
        except BaseException:
            self.close()
            raise

    # --- backends -------------------------------------------------------------------------------------

    def _open_tensorboard(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb_pending = False
        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
        if self._config:
            text = json.dumps(self._config, indent=2, default=str)
            # Indented by four spaces: a Markdown code block, so TensorBoard shows it verbatim.
            self._tb.add_text("config", "\n".join("    " + line for line in text.splitlines()), purge_step or 0)
            self._tb.flush()

    def _open_wandb(self, project: str, experiment: str) -> None:
        import wandb

        kwargs: dict[str, Any] = {"project": project, "name": experiment, "config": self._config,
                                  "dir": str(self.run_dir)}
        if not os.environ.get("WANDB_MODE") and not _wandb_has_credentials():
            kwargs["mode"] = "offline"
            logger.warning("wandb: no W&B API key (WANDB_API_KEY or `wandb login`), logging offline to %s; "
                           "upload it with `wandb sync`, or set WANDB_MODE to choose", self.run_dir / "wandb")
        id_file = self.run_dir / WANDB_ID_FILE
        if self._resume and id_file.exists() and (run_id := id_file.read_text().strip()):
            kwargs.update(id=run_id, resume="allow")
        self._wandb = wandb.init(**kwargs)
        id_file.write_text(self._wandb.id + "\n")

    def _open_mlflow(self, project: str, experiment: str) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.run_dir / "mlruns").resolve().as_uri()
            # Recent MLflow keeps its file store behind this opt-in; a store inside the run is the point here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        id_file = self.run_dir / MLFLOW_ID_FILE
        run_id = None
        if self._resume and id_file.exists() and (stored := id_file.read_text().strip()):
            try:
                client.get_run(stored)
                client.update_run(stored, status="RUNNING")
                run_id = stored
            except MlflowException:
                logger.warning("mlflow: run %s (from %s) is not in %s; starting a new run", stored, id_file, uri)
        if run_id is None:
            exp = client.get_experiment_by_name(project)
            if exp is not None and exp.lifecycle_stage == "deleted":
                raise ConfigError(f"MLflow experiment '{project}' (trainer.project_name) is deleted in {uri}: "
                                  "restore it or choose another project name")
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(project)
            run_id = client.create_run(exp_id, run_name=experiment, tags=_mlflow_tags(self.run_dir)).info.run_id
            id_file.write_text(run_id + "\n")
        self._mlflow, self._mlflow_run_id = client, run_id
        params = {_mlflow_key(k): _mlflow_value(v) for k, v in _flatten(self._config).items()}
        if self._resume:
            # Params of an MLflow run cannot change: log only the new ones.
            old = client.get_run(run_id).data.params
            changed = sorted(k for k, v in params.items() if k in old and old[k] != v)
            if changed:
                shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
                logger.warning("mlflow: params differ from the resumed run's and are kept as they were: %s", shown)
            params = {k: v for k, v in params.items() if k not in old}
        if params:
            from mlflow.entities import Param

            client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])

    # --- logging --------------------------------------------------------------------------------------

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` for ``step``; values that are not finite real numbers are dropped."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, numbers.Real) and math.isfinite(float(v))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if "console" in self.backends:
            shown = [f"{k}={clean[k]:.4g}" for k in _CONSOLE_KEYS if k in clean]
            shown += [f"{k}={v:.4g}" for k, v in clean.items() if k.startswith("val/") and k.endswith("mean@1")]
            logger.info("step %d: %s", step, " ".join(shown))
        if self._tb_pending:
            self._open_tensorboard(purge_step=step)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None and clean:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None and clean:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            named = {_mlflow_key(k): v for k, v in clean.items()}
            self._mlflow.log_batch(self._mlflow_run_id, metrics=[Metric(k, v, now, step) for k, v in named.items()])

    def log_generations(self, rows: list[dict], step: int, *, name: str = "val/generations") -> None:
        """Show generated samples as a table (:func:`polyrl.trainer.generations.table` picks the columns): a
        ``wandb.Table`` in W&B, a Markdown table in TensorBoard's text tab, ``generations/<name>_step_<step>.json``
        (MLflow's table format: ``columns`` and ``data``) among the MLflow run's artifacts. Console and jsonl
        show nothing (the rows are in the run's JSONL files)."""
        from polyrl.trainer.generations import table

        if not rows:
            return
        columns, data = table(rows)
        if self._tb_pending:
            self._open_tensorboard(purge_step=step)
        if self._tb is not None:
            self._tb.add_text(name, _markdown_table(columns, data), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=columns, data=data)}, step=step)
        if self._mlflow is not None:
            artifact = f"generations/{name.replace('/', '_')}_step_{step}.json"
            self._mlflow.log_text(self._mlflow_run_id, json.dumps({"columns": columns, "data": data}, default=str),
                                  artifact)

    def close(self) -> None:
        """Flush and close every backend.

        Called while an exception propagates (from a ``finally:``), the W&B run ends with exit code 1
        and the MLflow run as ``FAILED`` (``KILLED`` on Ctrl-C).
        """
        error = sys.exc_info()[1]
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        self._tb_pending = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish(exit_code=1 if error is not None else 0)
        if self._mlflow is not None:
            client, self._mlflow = self._mlflow, None
            status = ("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED") if error is not None else "FINISHED"
            client.set_terminated(self._mlflow_run_id, status=status)


def _markdown_table(columns: list[str], data: list[list[Any]]) -> str:
    """A Markdown table; cell text keeps its line breaks as ``<br>`` and its pipes escaped."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def check_loggers(backends: Sequence[str]) -> None:
    """Raise a one-line :class:`~polyrl.errors.ConfigError` naming ``trainer.logger`` when a backend is unknown or
    its package is not installed. A start-up check (``polyrl train --dry-run`` makes it): verl's default logger list
    holds ``wandb``, which a run would otherwise stop on only when it opens its loggers."""
    unknown = [b for b in backends if b not in _BACKENDS]
    if unknown:
        raise ConfigError(f"trainer.logger: unknown logger {', '.join(map(repr, unknown))}; choose from "
                          f"{', '.join(_BACKENDS)}")
    for name in ("tensorboard", "wandb", "mlflow"):
        if name in backends:
            _require(name)


def _require(name: str) -> None:
    """Import ``name``'s library or raise a ConfigError with the install line."""
    try:  # torch's SummaryWriter needs the tensorboard package
        importlib.import_module({"tensorboard": "torch.utils.tensorboard"}.get(name, name))
    except ImportError:
        raise ConfigError(
            f"trainer.logger asks for '{name}', which is not installed: pip install 'polyrl[{name}]' "
            f"(or pip install {_PIP[name]}), or remove it from trainer.logger"
        ) from None


def _wandb_has_credentials() -> bool:
    """Whether W&B would find an API key without prompting: the environment or a ``.netrc`` entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    paths = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for path in paths:
        try:
            if netrc.netrc(os.path.expanduser(path)).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def _mlflow_key(key: str) -> str:
    """``key`` as a valid MLflow metric / param name: ``@`` -> ``_at_``, other invalid characters -> ``_``."""
    key = _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))
    # MLflow also rejects names that are not normalised paths ("a//b", "a/./b", "../a", "/a", "a/").
    parts = ["__" if p == ".." else p for p in key.split("/") if p not in ("", ".")]
    return "/".join(parts)[:_MLFLOW_MAX_KEY].rstrip("/") or "_"


def _mlflow_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MLFLOW_MAX_VALUE else text[:_MLFLOW_MAX_VALUE - 3] + "..."


def _mlflow_tags(run_dir: Path) -> dict[str, str]:
    tags = {"polyrl.run_dir": str(run_dir.resolve())}
    try:  # the source / user tags that mlflow.start_run adds
        from mlflow.tracking.context.registry import resolve_tags

        return resolve_tags(tags)
    except Exception:  # only nice to have
        return tags


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of a run's ``metrics.jsonl`` (the last row per step wins after a resume)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a polyrl run directory?")
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]
