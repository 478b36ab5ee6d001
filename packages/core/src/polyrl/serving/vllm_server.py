"""The ``vllm`` backend of ``polyrl serve``: vLLM's own OpenAI server, run as a child process.

The child is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) with this
interpreter, bound to the host and port ``polyrl serve`` was given. SIGINT and SIGTERM are passed on to
it as SIGINT (vLLM's clean shutdown; on SIGTERM its engine core logs a traceback); ``polyrl serve`` returns when the child has exited, and kills it
if it has not within :data:`STOP_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("polyrl.serve")

#: Seconds the child has to stop after SIGINT before it is killed.
STOP_TIMEOUT_S = 30.0


def vllm_command(model_dir: str | Path, model_name: str, *, host: str, port: int, trust_remote_code: bool = False,
                 max_model_len: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of vLLM's OpenAI server for this model."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_name, "--host", host, "--port", str(port)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args)


def run_vllm_server(model_dir: str | Path, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                    trust_remote_code: bool = False, max_model_len: int | None = None,
                    extra_args: Sequence[str] = (), ready: Callable[[str], None] | None = None) -> int:
    """Run vLLM's server until it exits or SIGINT/SIGTERM arrives; returns 0 after a requested stop, else the
    child's exit code."""
    cmd = vllm_command(model_dir, model_name, host=host, port=port, trust_remote_code=trust_remote_code,
                       max_model_len=max_model_len, extra_args=extra_args)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU build's default (4) is a lot for a laptop
    log.info("polyrl serve: starting vLLM's OpenAI server for '%s': %s", model_name, " ".join(cmd))
    child = subprocess.Popen(cmd, env=env, start_new_session=True)  # our Ctrl-C reaches it once, through us
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            log.info("polyrl serve: %s received, stopping vLLM", signal.Signals(signum).name)
            if child.poll() is None:
                child.send_signal(signal.SIGINT)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
    try:
        threading.Thread(target=_announce_when_up, args=(url, model_name, child, stopping, ready), daemon=True).start()
        while child.poll() is None and not stopping.is_set():
            time.sleep(0.2)
        if stopping.is_set():
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("polyrl serve: vLLM did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            log.info("polyrl serve: stopped")
            return 0
        return child.returncode or 0
    finally:
        if child.poll() is None:  # an error here: do not leave the server behind
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _announce_when_up(url: str, model_name: str, child: subprocess.Popen, stopping: threading.Event,
                      ready: Callable[[str], None] | None) -> None:
    while child.poll() is None and not stopping.is_set():
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                log.info("polyrl serve: model '%s' at %s (vllm backend); stop with Ctrl-C", model_name, url)
                if ready is not None:
                    ready(url)
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
