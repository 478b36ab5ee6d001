"""The python tool's sandbox: escapes are contained and reported as tool errors; the trainer keeps running."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
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
    assert r.error == "CPU time limit of 2 s exceeded" and r.returncode != 0 and not r.timed_out


@needs_ns
def test_cpu_limit_is_reported_even_when_the_code_ignores_sigxcpu():
    # PID 1 of the namespace: the hard limit's SIGKILL ends it; unshare's complaint is not the code's output
    box = Sandbox(SandboxLimits(timeout_s=15, cpu_s=1, memory_mb=256))
    r = box.run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass")
    assert r.error == "CPU time limit of 1 s exceeded" and not r.ok and not r.timed_out
    assert "sigprocmask" not in r.stdout and "unshare" not in r.stdout


@needs_ns
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/etc/shadow"), reason="needs a root trainer")
def test_a_root_trainer_is_not_root_in_the_sandbox(box):
    assert os.access("/etc/shadow", os.R_OK)  # the trainer (host root) can read it
    r = box.run("print(open('/etc/shadow').read())")
    assert not r.ok and "PermissionError" in r.stdout and "root:" not in r.stdout
    # RLIMIT_NPROC applies (it never applies to the host's root)
    r = box.run("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                "    print(type(e).__name__)\nprint(n)")
    assert r.ok and r.stdout.split()[0] == "BlockingIOError" and int(r.stdout.split()[1]) < 8


@needs_ns
def test_scratch_is_a_size_limited_tmpfs(box):
    r = box.run("import os\nst = os.statvfs('/scratch')\nprint(st.f_blocks * st.f_frsize >> 20, flush=True)\n"
                "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (10 << 20))")
    assert int(r.stdout.split()[0]) <= 64 and "No space left on device" in r.stdout and not r.ok


@needs_ns
def test_calls_leave_nothing_in_tmp(box):
    def ours():
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("polyrl-")}

    before = ours()
    for _ in range(3):
        assert box.run("print(1)").ok
    assert ours() <= before


@needs_ns
def test_a_setup_failure_is_an_explicit_error():
    r = Sandbox(python="/nonexistent/python3").run("print(1)")
    assert r.error.startswith("sandbox setup failed: ") and "/nonexistent/python3" in r.error and not r.ok


def test_the_probe_runs_the_real_setup(monkeypatch):
    import polyrl.tools.sandbox as sandbox
    from polyrl.tools.sandbox import SandboxResult

    seen = []

    def failing(self, code):
        seen.append(code)
        return SandboxResult("mount: /proc: permission denied", "", 32, error="sandbox setup failed: mount: /proc")

    monkeypatch.setattr(sandbox, "_NS_PROBE", None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: "/usr/bin/" + name)
    monkeypatch.setattr(sandbox.Sandbox, "_run_isolated", failing)
    ok, why = namespaces_available()
    assert not ok and seen == ["pass"] and "mount: /proc" in why
    r = Sandbox().run("print(1)")
    assert "python sandbox unavailable" in r.error and seen == ["pass"]  # probed once


def test_arun_does_not_queue_behind_the_default_thread_pool():
    box = Sandbox(SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=256), isolation="none")

    async def many():
        return await asyncio.gather(*(box.arun("import time\ntime.sleep(1.5)") for _ in range(40)))

    start = time.monotonic()
    results = asyncio.run(many())
    assert all(r.ok for r in results) and time.monotonic() - start < 6  # 40 calls at once, not 6 at a time


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
    assert "CPU time limit" in env or "timed out" in env
    assert "4" in env


def test_missing_namespaces_is_a_clear_tool_error(monkeypatch):
    import polyrl.tools.sandbox as sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    r = Sandbox().run("print(1)")
    assert not r.ok and "python sandbox unavailable" in r.error and "isolation: none" in r.error
    with pytest.raises(RuntimeError, match="sandbox unavailable"):
        asyncio.run(PythonTool().execute({"code": "print(1)"}, {}))


def test_isolation_none_still_limits(tmp_path):
    box = Sandbox(SandboxLimits(timeout_s=2, cpu_s=1, memory_mb=256), isolation="none")
    r = box.run("import os\nprint(os.getcwd().startswith('/tmp') or 'scratch' in os.getcwd())\nprint(len(os.environ))")
    assert r.ok and r.stdout.split() == ["True", "3"]
    assert not box.run("x = bytearray(2 << 30)").ok
    assert box.run("while True: pass").error == "CPU time limit of 1 s exceeded"
    with pytest.raises(ValueError, match="isolation='chroot'"):
        Sandbox(isolation="chroot")


def test_the_parent_process_is_untouched():
    # everything above ran in children: this process still has its network stack and environment
    assert os.environ.get("POLYRL_TEST_SECRET") == "env-s3cret"
    socket.socket().close()
