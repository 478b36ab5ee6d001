"""Metric sinks: console, jsonl, and TensorBoard / W&B / MLflow when installed and configured."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
_PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: Shown on the console line, in this order, when present.
_CONSOLE_KEYS = (
    "critic/score/mean", "acc/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
    "timing/step", "throughput/tokens_per_s",
)


class Tracker:
    """Sends each step's metrics to every configured backend."""

    def __init__(self, backends: list[str], run_dir: str | Path, *, project: str, experiment: str,
                 config: dict[str, Any] | None = None, resume: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.backends = list(backends)
        unknown = [b for b in self.backends if b not in _BACKENDS]
        if unknown:
            raise ConfigError(f"trainer.logger: unknown logger {unknown}; choose from {', '.join(_BACKENDS)}")
        self._jsonl = None
        self._tb = self._wandb = self._mlflow = None
        if "jsonl" in self.backends:
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a" if resume else "w")  # noqa: SIM115
        for name in ("tensorboard", "wandb", "mlflow"):
            if name in self.backends:
                try:
                    self._open(name, project, experiment, config or {})
                except ImportError:
                    raise ConfigError(
                        f"trainer.logger asks for '{name}', which is not installed: pip install {_PIP[name]}"
                    ) from None

    def _open(self, name: str, project: str, experiment: str, config: dict) -> None:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        elif name == "wandb":
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.run_dir))
        elif name == "mlflow":
            import mlflow

            mlflow.set_experiment(project)
            self._mlflow = mlflow.start_run(run_name=experiment)
            mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` for ``step``."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if "console" in self.backends:
            shown = [f"{k}={clean[k]:.4g}" for k in _CONSOLE_KEYS if k in clean]
            shown += [f"{k}={v:.4g}" for k, v in clean.items() if k.startswith("val/") and k.endswith("mean@1")]
            print(f"step {step}: " + " ".join(shown), file=sys.stderr, flush=True)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in clean.items()}, step=step)

    def close(self) -> None:
        """Flush and close every backend."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()


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
