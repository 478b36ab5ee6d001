"""``sandbox_fusion``: programs run on a SandboxFusion server (https://github.com/bytedance/SandboxFusion),
through its documented ``POST /run_code`` API (verl's ``reward_model.sandbox_fusion``).

Request (JSON): ``code``, ``language``, ``stdin``, ``compile_timeout``, ``run_timeout`` (seconds),
``memory_limit_MB``, ``files`` and ``fetch_files`` (empty). Response: ``status`` (``Success`` / ``Failed`` /
``SandboxError``), ``message``, and ``compile_result`` / ``run_result``, each ``{status: Finished | Error |
TimeLimitExceeded, execution_time, return_code, stdout, stderr}`` or null. Mapped onto
:class:`~polyrl.sandboxes.base.ExecutionResult`:

==========================================================  ==================
server answer                                               status
==========================================================  ==================
``Success``, run ``Finished``                               ``ok``
``Failed``, compile ``TimeLimitExceeded``                   ``timeout``
``Failed``, compile ``Error`` or exit != 0                  ``compile_error``
``Failed``, run ``TimeLimitExceeded``                       ``timeout``
``Failed``, run ``Error`` or ``Finished`` with exit != 0    ``error``
``SandboxError``; HTTP 4xx (422: a request it refused);     ``sandbox_error``
HTTP 5xx after retries; no answer in time; not JSON
==========================================================  ==================

HTTP 502 / 503 / 504 (a gateway or a busy server) and a refused or reset connection are retried
(``reward.sandbox_fusion.retries``, waiting 0.5 s, 1 s, ...), as verl retries 504. ``check()`` sends ``print(1)``
once at start-up, so an unreachable URL is one line before training instead of a failure per sample. Requests
go through the standard library (``urllib``); nothing else is installed for it.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from polyrl.errors import ConfigError
from polyrl.sandboxes.base import ExecutionResult

log = logging.getLogger("polyrl.rewards")

#: HTTP statuses worth another try (a gateway that timed out, a server busy or restarting).
RETRY_STATUSES = (502, 503, 504)


def run_code_url(url: str) -> str:
    """The ``run_code`` endpoint of ``url``: verl passes the endpoint itself (``http://host:8080/run_code``); a
    server's base URL (``http://host:8080``) gets ``/run_code`` appended."""
    url = url.strip()
    return url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"


class SandboxFusionSandbox:
    """An HTTP client of one SandboxFusion server (``reward.sandbox_fusion``: ``url``, ``memory_limit_mb``,
    ``request_timeout_s``, ``retries``)."""

    name = "sandbox_fusion"

    def __init__(self, config: Any = None) -> None:
        sf = getattr(config, "sandbox_fusion", None)
        url = str(getattr(sf, "url", "") or "")
        if not url:
            raise ConfigError("reward.sandbox=sandbox_fusion needs reward.sandbox_fusion.url (the server's run_code "
                              "endpoint, e.g. http://127.0.0.1:8080/run_code)")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.sandbox_fusion.url={url!r}: give an http:// or https:// URL")
        self.url = run_code_url(url)
        self.memory_mb = int(getattr(sf, "memory_limit_mb", 1024))
        self.request_timeout_s = float(getattr(sf, "request_timeout_s", 30.0))
        self.retries = int(getattr(sf, "retries", 2))
        self.check_timeout_s = float(getattr(sf, "check_timeout_s", 10.0))

    # ------------------------------------------------------------------ the API
    def _post(self, payload: dict[str, Any], timeout: float) -> tuple[int | None, Any, str]:
        """``(http status, JSON body, error)``: status None when no HTTP answer came."""
        data = json.dumps(payload).encode()
        request = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")[:300] if exc.fp is not None else ""
            return exc.code, None, f"HTTP {exc.code} {exc.reason}: {text}".strip()
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                return None, None, f"no answer within {timeout:g} s"
            return None, None, f"cannot connect ({reason})"
        except TimeoutError:
            return None, None, f"no answer within {timeout:g} s"
        except (ConnectionError, OSError) as exc:  # reset mid-answer
            return None, None, f"connection failed ({exc})"
        try:
            return status, json.loads(body.decode("utf-8")), ""
        except (UnicodeDecodeError, json.JSONDecodeError):
            return status, None, f"HTTP {status} but the answer is not JSON: {body[:200]!r}"

    def _request(self, payload: dict[str, Any], timeout: float, retries: int) -> tuple[Any, str]:
        """The JSON answer, or ``(None, why)``; retries what :data:`RETRY_STATUSES` and dropped connections."""
        why = ""
        for attempt in range(retries + 1):
            status, body, why = self._post(payload, timeout)
            if body is not None and status is not None and status < 400:
                return body, ""
            retry = status in RETRY_STATUSES or (status is None and why.startswith(("cannot connect", "connection")))
            if not retry or attempt == retries:
                break
            time.sleep(0.5 * (attempt + 1))
        return None, why

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0, language: str = "python",
            memory_mb: int | None = None) -> ExecutionResult:
        """Run ``code`` on the server; see the module docstring for how its answer maps to a status."""
        payload = {"code": code, "language": language, "stdin": stdin, "compile_timeout": timeout_s,
                   "run_timeout": timeout_s, "memory_limit_MB": int(memory_mb or self.memory_mb), "files": {},
                   "fetch_files": []}
        start = time.monotonic()
        body, why = self._request(payload, 2 * timeout_s + self.request_timeout_s, self.retries)
        if body is None:
            return ExecutionResult("sandbox_error", duration_s=time.monotonic() - start,
                                   detail=f"SandboxFusion at {self.url}: {why}")
        return result_of(body, time.monotonic() - start)

    def check(self) -> None:
        """One ``print(1)`` at start-up: an unreachable server or one that cannot run Python is one
        :class:`ConfigError` naming ``reward.sandbox_fusion.url``."""
        payload = {"code": "print(1)", "language": "python", "stdin": "", "compile_timeout": 5, "run_timeout": 5,
                   "memory_limit_MB": self.memory_mb, "files": {}, "fetch_files": []}
        body, why = self._request(payload, self.check_timeout_s, 0)
        if body is None:
            raise ConfigError(f"reward.sandbox_fusion.url={self.url}: {why}; start a SandboxFusion server there "
                              "(docs/reward_models.md) or set reward.sandbox=local")
        result = result_of(body, 0.0)
        if not result.ok or result.stdout.strip() != "1":
            raise ConfigError(f"reward.sandbox_fusion.url={self.url}: the server did not run print(1) ({result.status}:"
                              f" {result.detail or result.stdout[:100]!r}); check the server's logs")


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def result_of(body: Any, duration_s: float) -> ExecutionResult:
    """A ``run_code`` answer as an :class:`ExecutionResult` (the table in the module docstring)."""
    if not isinstance(body, dict) or "status" not in body:
        return ExecutionResult("sandbox_error", duration_s=duration_s,
                               detail=f"SandboxFusion answered without a status: {str(body)[:200]}")
    status = body.get("status")
    message = str(body.get("message") or "")
    compiled = body.get("compile_result") or {}
    ran = body.get("run_result") or {}
    out, err = str(ran.get("stdout") or ""), str(ran.get("stderr") or "")
    code = _int(ran.get("return_code"))
    took = ran.get("execution_time")
    duration = float(took) if isinstance(took, (int, float)) else duration_s
    if status == "SandboxError":
        return ExecutionResult("sandbox_error", out, err, code, duration, f"SandboxError: {message}".strip())
    if status == "Success" and ran.get("status") == "Finished":
        return ExecutionResult("ok", out, err, code if code is not None else 0, duration)
    if status == "Failed" or status == "Success":
        cstatus = compiled.get("status")
        if cstatus == "TimeLimitExceeded":
            return ExecutionResult("timeout", out, str(compiled.get("stderr") or err), None, duration,
                                   "compile time limit exceeded")
        if cstatus == "Error" or (cstatus == "Finished" and _int(compiled.get("return_code")) not in (0, None)):
            return ExecutionResult("compile_error", str(compiled.get("stdout") or ""), str(compiled.get("stderr") or ""),
                                   _int(compiled.get("return_code")), duration, "compile error")
        rstatus = ran.get("status")
        if rstatus == "TimeLimitExceeded":
            return ExecutionResult("timeout", out, err, None, duration, "run time limit exceeded")
        if rstatus in ("Error", "Finished"):
            return ExecutionResult("error", out, err, code, duration,
                                   f"exit status {code}" if code is not None else (message or "run error"))
    return ExecutionResult("sandbox_error", out, err, code, duration,
                           f"SandboxFusion answered status={status!r}, run={ran.get('status')!r}: {message}")
