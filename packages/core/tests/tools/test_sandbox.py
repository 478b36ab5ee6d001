"""The python tool's sandbox: escapes are contained and reported as tool errors; the trainer keeps running."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from polyrl.tools.builtin import PythonTool
from polyrl.tools.sandbox import Sandbox, SandboxLimits, namespaces_available

NS_OK, NS_WHY = namespaces_available()
needs_ns = pytest.mark.skipif(not NS_OK, reason=f"namespaces not permitted here: {NS_WHY}")


@pytest.fixture(scope="module")
def box():
    return Sandbox(SandboxLimits(timeout_s=3, cpu_s=2, memory_mb=256, max_processes=8, max_output_bytes=4096))


@pytest.fixture(scope="module", autouse=True)
def trainer_secret(tmp_path_factory):
    """A file and an environment variable of the 'trainer' that the sandbox must not see."""
    path = tmp_path_factory.mktemp("trainer") / "secret.txt"
    path.write_text("s3cret")
    os.environ["POLYRL_TEST_SECRET"] = "env-s3cret"
    yield path
    os.environ.pop("POLYRL_TEST_SECRET", None)


@needs_ns
def test_runs_code_and_returns_output(box):
    r = box.run("import sys\nprint(sum(range(10)))\nprint(sys.version_info[0])")
    assert r.ok and r.stdout.split() == ["45", "3"]


@needs_ns
def test_no_network(box):
    r = box.run("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))")
    assert not r.ok and ("Network is unreachable" in r.stdout or "OSError" in r.stdout)
    r = box.run("import socket\nprint(socket.if_nameindex())")
    assert r.ok and "eth" not in r.stdout  # only the (down) loopback


@needs_ns
def test_no_writes_outside_scratch(box, trainer_secret):
    for target in ["/usr/evil", "/tmp/evil", str(trainer_secret.parent / "evil"), "/etc/evil", "/evil"]:
        r = box.run(f"open({target!r}, 'w').write('x')")
        assert not r.ok and ("Read-only file system" in r.stdout or "No such file" in r.stdout), target
        assert not os.path.exists(target)
    assert box.run("open('/scratch/ok.txt', 'w').write('x'); print(open('ok.txt').read())").stdout.strip() == "x"


@needs_ns
def test_cannot_read_the_trainers_files_or_environment(box, trainer_secret):
    r = box.run(f"print(open({str(trainer_secret)!r}).read())")
    assert not r.ok and "s3cret" not in r.stdout
    r = box.run("import os\nprint(dict(os.environ))\nprint(open('/proc/1/environ').read())\nprint(os.listdir('/'))")
    assert r.ok and "env-s3cret" not in r.stdout and "POLYRL_TEST_SECRET" not in r.stdout
    assert "work" not in r.stdout.split("\n")[2] and "home" not in r.stdout.split("\n")[2]
    r = box.run(f"import os\nprint(os.path.exists({os.getcwd()!r}), os.path.exists('/proc/{os.getpid()}/environ'))")
    assert r.stdout.split() == ["False", "False"]


@needs_ns
def test_cannot_undo_the_isolation(box):
    r = box.run("import subprocess\nprint(subprocess.run(['mount', '-o', 'remount,rw', '/usr'], capture_output=True)"
                ".returncode)\nprint(subprocess.run(['unshare', '--user', '--map-root-user', 'true'], "
                "capture_output=True).returncode)")
    assert r.ok and r.stdout.split() != ["0", "0"] and r.stdout.split()[0] != "0"


@needs_ns
def test_fork_bomb_is_contained(box):
    start = time.monotonic()
    r = box.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert not r.ok and time.monotonic() - start < 10
    assert r.timed_out or "BlockingIOError" in r.stdout or r.error


@needs_ns
def test_memory_bomb_is_contained(box):
    r = box.run("x = bytearray(2 << 30)")
    assert not r.ok and "MemoryError" in r.stdout


@needs_ns
def test_infinite_loop_is_killed(box):
    start = time.monotonic()
    r = box.run("while True:\n    pass")
    assert not r.ok and time.monotonic() - start < 6
    assert "CPU limit" in r.error or "timed out" in r.error


@needs_ns
def test_huge_output_is_cut(box):
    r = box.run("while True:\n    print('a' * 1000)")
    assert not r.ok and r.truncated and len(r.stdout) <= 4096 and "output exceeded" in r.error


@needs_ns
def test_python_tool_reports_escapes_as_tool_errors_and_keeps_going():
    from polyrl.agent_loops import ToolAgentLoop
    from polyrl.config.schema import AgentConfig
    from polyrl.models.tiny import build_char_tokenizer
    from polyrl.protocols import GenerationResult, SamplingParams
    from polyrl.tools.parsers import HermesParser

    tok = build_char_tokenizer()
    py = PythonTool({"timeout_s": 2, "cpu_s": 1, "memory_mb": 256})
    loop = ToolAgentLoop(tokenizer=tok, config=AgentConfig(max_tool_response_length=200), tools={"python": py},
                         parser=HermesParser())
    import json

    codes = ["import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)", "while True: pass",
             "print(2 + 2)"]
    calls = "".join("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": c}}) + "</tool_call>"
                    for c in codes)

    class Client:
        n = 0

        async def agenerate(self, req):
            Client.n += 1
            text = calls if Client.n == 1 else "done"
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            return [GenerationResult(req.prompt_ids, ids, [0.0] * len(ids))]

    out = asyncio.run(loop.run({"prompt_ids": [1, 2], "uid": "x"}, SamplingParams(max_new_tokens=1024), Client()))
    env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert out.metrics["tool_errors"] == 2 and out.metrics["tool_calls"] == 3 and out.finish_reason == "stop"
    assert "Network is unreachable" in env or "OSError" in env
    assert "CPU limit" in env or "timed out" in env
    assert "4" in env


def test_missing_namespaces_is_a_clear_tool_error(monkeypatch):
    import polyrl.tools.sandbox as sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    r = Sandbox().run("print(1)")
    assert not r.ok and "python sandbox unavailable" in r.error and "isolation: none" in r.error
    with pytest.raises(RuntimeError, match="sandbox unavailable"):
        asyncio.run(PythonTool().execute({"code": "print(1)"}, {}))


def test_isolation_none_still_limits(tmp_path):
    box = Sandbox(SandboxLimits(timeout_s=2, cpu_s=1, memory_mb=256), isolation="none")
    r = box.run("import os\nprint(os.getcwd().startswith('/tmp') or 'scratch' in os.getcwd())\nprint(len(os.environ))")
    assert r.ok and r.stdout.split() == ["True", "3"]
    assert not box.run("x = bytearray(2 << 30)").ok
    assert "CPU limit" in box.run("while True: pass").error or "timed out" in box.run("while True: pass").error
    with pytest.raises(ValueError, match="isolation='chroot'"):
        Sandbox(isolation="chroot")


def test_the_parent_process_is_untouched():
    # everything above ran in children: this process still has its network stack and environment
    assert os.environ.get("POLYRL_TEST_SECRET") == "env-s3cret"
    socket.socket().close()
