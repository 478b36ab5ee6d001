"""The ``sandbox_fusion`` client against a FAKE SandboxFusion server (a test double: a real SandboxFusion server
cannot run here). The double is a small HTTP server on 127.0.0.1 in this file that speaks SandboxFusion's
documented ``POST /run_code`` API: it takes the request's fields and answers ``{status, message, compile_result,
run_result}`` the way the real server does for a program that finishes, fails, runs out of time, or that the
server itself cannot run, and it can answer HTTP errors or not at all."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from polyrl.errors import ConfigError
from polyrl.rewards.code import CodeScorer, SandboxUnavailable, build_code_scorer, code_score
from polyrl.rewards.config import CodeRewardConfig, RewardConfig
from polyrl.sandboxes.sandbox_fusion import SandboxFusionSandbox, run_code_url

ADD_STDIO = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def _fake_run(request: dict[str, Any]) -> dict[str, Any]:
    """What the fake server answers for a request: it 'runs' a few known programs by matching their text."""
    code, stdin = request["code"], request.get("stdin", "")

    def run(status: str, stdout: str = "", stderr: str = "", rc: int | None = 0) -> dict[str, Any]:
        return {"status": status, "execution_time": 0.01, "return_code": rc, "stdout": stdout, "stderr": stderr}

    if "SANDBOX_BROKEN" in code:
        return {"status": "SandboxError", "message": "runner crashed", "compile_result": None, "run_result": None}
    if "while True" in code:
        return {"status": "Failed", "message": "", "compile_result": None, "run_result": run("TimeLimitExceeded", rc=None)}
    if "raise" in code:
        return {"status": "Failed", "message": "", "compile_result": None,
                "run_result": run("Finished", stderr="Traceback...\nValueError", rc=1)}
    if code.startswith("print(1)"):
        return {"status": "Success", "message": "", "compile_result": None, "run_result": run("Finished", "1\n")}
    if "a + b" in code:
        a, b = map(int, stdin.split())
        return {"status": "Success", "message": "", "compile_result": None, "run_result": run("Finished", f"{a + b}\n")}
    return {"status": "Failed", "message": "", "compile_result": None, "run_result": run("Error", stderr="?", rc=1)}


class FakeSandboxFusion:
    """A FAKE SandboxFusion server (test double) on 127.0.0.1: ``mode`` is ``ok`` (answers as the API says),
    ``http_503_once`` (one 503, then ok), ``http_500`` / ``http_422`` (always that error), ``silent`` (never
    answers)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests: list[dict[str, Any]] = []
        #: Seconds each answer waits (to see requests overlap), and the most requests it held at once.
        self.delay_s = 0.0
        self.peak_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, **body})
                if fake.mode == "silent":
                    time.sleep(3)
                    return
                if fake.mode == "http_503_once" and len(fake.requests) == 1 or fake.mode in ("http_500", "http_422"):
                    code = {"http_500": 500, "http_422": 422}.get(fake.mode, 503)
                    self.send_response(code)
                    self.end_headers()
                    self.wfile.write(b'{"detail": "nope"}')
                    return
                with fake._lock:
                    fake._in_flight += 1
                    fake.peak_in_flight = max(fake.peak_in_flight, fake._in_flight)
                time.sleep(fake.delay_s)
                with fake._lock:
                    fake._in_flight -= 1
                data = json.dumps(_fake_run(body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeSandboxFusion]:
    server = FakeSandboxFusion()
    yield server
    server.close()


def client(url: str, **kw: Any) -> SandboxFusionSandbox:
    reward = RewardConfig(sandbox="sandbox_fusion")
    reward.sandbox_fusion.url = url
    for k, v in kw.items():
        setattr(reward.sandbox_fusion, k, v)
    return SandboxFusionSandbox(reward)


def test_code_rewards_run_on_the_fake_server_through_its_run_code_api(fake):
    reward = RewardConfig(sandbox="auto")
    reward.sandbox_fusion.url = fake.url.removesuffix("/run_code")  # a base URL gets /run_code
    scorer = build_code_scorer(reward)
    assert scorer.sandbox.name == "sandbox_fusion"  # auto: the URL picks it
    assert scorer("apps", ADD, ADD_STDIO)["score"] == 1.0
    first = fake.requests[0]
    assert first["path"] == "/run_code" and first["language"] == "python" and first["stdin"] == "1 2\n"
    assert first["run_timeout"] == 5.0 and first["memory_limit_MB"] == 1024 and "a + b" in first["code"]
    assert scorer("apps", "```python\nraise ValueError\n```", ADD_STDIO) == \
        {"score": 0.0, "acc": 0.0, "passed": 0, "total": 2, "timeouts": 0, "errors": 1}  # stopped at the first


def test_the_servers_statuses_map_onto_results(fake):
    sandbox = client(fake.url)
    assert sandbox.run("print(1)").ok
    assert sandbox.run("while True: pass", timeout_s=1).status == "timeout"
    failed = sandbox.run("raise ValueError")
    assert failed.status == "error" and failed.return_code == 1 and "ValueError" in failed.stderr
    broken = sandbox.run("SANDBOX_BROKEN")
    assert broken.status == "sandbox_error" and "runner crashed" in broken.detail


def test_a_sandbox_error_gives_the_fallback_not_a_zero(fake):
    scorer = CodeScorer(client(fake.url), CodeRewardConfig())
    with pytest.raises(SandboxUnavailable, match="runner crashed"):
        scorer("apps", "```python\nSANDBOX_BROKEN\n```", ADD_STDIO)


def test_http_errors_retry_503_and_give_up_on_500_and_422():
    once = FakeSandboxFusion("http_503_once")
    try:
        assert client(once.url, retries=1).run("print(1)").ok and len(once.requests) == 2
    finally:
        once.close()
    for mode, code in (("http_500", "500"), ("http_422", "422")):
        server = FakeSandboxFusion(mode)
        try:
            result = client(server.url, retries=2).run("print(1)")
            assert result.status == "sandbox_error" and f"HTTP {code}" in result.detail
            assert len(server.requests) == 1  # not retried
        finally:
            server.close()


def test_a_server_that_does_not_answer_times_out_as_a_sandbox_error():
    silent = FakeSandboxFusion("silent")
    try:
        start = time.monotonic()
        result = client(silent.url, request_timeout_s=0.5, retries=0).run("print(1)", timeout_s=0.1)
        assert result.status == "sandbox_error" and "no answer within" in result.detail
        assert time.monotonic() - start < 2.5
        with pytest.raises(ConfigError, match=r"reward.sandbox_fusion.url=.*no answer within"):
            client(silent.url, check_timeout_s=0.5).check()
    finally:
        silent.close()


def test_an_unreachable_url_is_one_line_at_start_up(fake):
    client(fake.url).check()  # a server that runs print(1) passes
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ConfigError) as err:
        client(f"http://127.0.0.1:{port}/run_code", retries=0).check()
    assert "\n" not in str(err.value) and "cannot connect" in str(err.value)
    assert "reward.sandbox=local" in str(err.value)
    with pytest.raises(ConfigError, match="needs reward.sandbox_fusion.url"):
        SandboxFusionSandbox(RewardConfig(sandbox="sandbox_fusion"))
    with pytest.raises(ConfigError, match="http:// or https://"):
        client("127.0.0.1:8080")


def test_verls_sandbox_fusion_url_keyword_reaches_the_server(fake):
    assert code_score("apps", ADD, ADD_STDIO, sandbox_fusion_url=fake.url)["score"] == 1.0
    assert fake.requests  # it ran there, not in the local sandbox
    assert run_code_url("http://h:8080/") == "http://h:8080/run_code"
    assert run_code_url("http://h:8080/run_code") == "http://h:8080/run_code"


@pytest.mark.parametrize(("max_concurrent", "peak"), [(1, 1), (0, 3)])
def test_max_concurrent_caps_the_requests_in_flight_to_the_server(fake, max_concurrent, peak):
    """verl's ``reward_model.sandbox_fusion.max_concurrent``: 3 samples scored on 3 threads
    (``reward.num_workers``), each test answered after 0.1 s; the fake server holds at most ``max_concurrent``
    requests at once (0: ``reward.num_workers`` alone caps them)."""
    from polyrl.rewards.managers import run_calls

    reward = RewardConfig(sandbox="sandbox_fusion", num_workers=3)
    reward.sandbox_fusion.url = fake.url
    reward.sandbox_fusion.max_concurrent = max_concurrent
    fake.delay_s = 0.1
    scorer = build_code_scorer(reward)
    results = run_calls(scorer, [("apps", ADD, ADD_STDIO)] * 3, num_workers=3, timeout_s=30)
    assert [r["score"] for r in results] == [1.0] * 3
    assert fake.peak_in_flight == peak

