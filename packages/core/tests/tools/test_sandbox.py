"""The python tool's sandbox: escapes are contained and reported as tool errors; the trainer keeps running."""

from __future__ import annotations

import asyncio
import os
import signal
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
    r = box.run("import os\nprint(dict(os.environ))\nprint(open('/proc/self/environ').read())\nprint(os.listdir('/'))")
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
def test_infinite_loop_is_killed():
    box = Sandbox(SandboxLimits(timeout_s=20, cpu_s=2, memory_mb=256))  # wall time to spare on a busy machine
    start = time.monotonic()
    r = box.run("while True:\n    pass")
    assert not r.ok and time.monotonic() - start < 15
    assert r.error == "CPU time limit of 2 s exceeded (killed by SIGXCPU)" and not r.timed_out
    assert r.signal == signal.SIGXCPU and r.returncode == -signal.SIGXCPU and r.limit == "cpu"


@needs_ns
def test_cpu_limit_is_reported_even_when_the_code_ignores_sigxcpu():
    # the hard limit's SIGKILL ends it; unshare's complaint is not the code's output
    box = Sandbox(SandboxLimits(timeout_s=30, cpu_s=1, memory_mb=256))
    r = box.run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass")
    assert r.error.startswith("CPU time limit of 1 s exceeded (killed by SIGKILL at the hard limit")
    assert not r.ok and not r.timed_out and r.signal == signal.SIGKILL and r.limit == "cpu"
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
def test_endless_output_is_stopped(box):
    r = box.run("while True:\n    print('a' * 1000)")
    assert not r.ok and r.truncated and r.limit == "output" and "output limit exceeded" in r.error
    assert len(r.stdout) <= 4096 + 100 and r.dropped_bytes > 0


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
    box = Sandbox(SandboxLimits(timeout_s=30, cpu_s=1, memory_mb=256), isolation="none")
    r = box.run("import os\nprint(os.getcwd().startswith('/tmp') or 'scratch' in os.getcwd())\nprint(len(os.environ))")
    assert r.ok and r.stdout.split() == ["True", "3"]
    assert not box.run("x = bytearray(2 << 30)").ok
    assert box.run("while True: pass").error == "CPU time limit of 1 s exceeded (killed by SIGXCPU)"
    with pytest.raises(ValueError, match="isolation='chroot'"):
        Sandbox(isolation="chroot")


def test_the_parent_process_is_untouched():
    # everything above ran in children: this process still has its network stack and environment
    assert os.environ.get("POLYRL_TEST_SECRET") == "env-s3cret"
    socket.socket().close()


# ---------------------------------------------------------------------- no process outlives its call

#: A process to leave behind: holds 16 MiB, says so on stdout and on the inherited pipe ``w``, then sleeps
#: (with ``handle``: handling SIGTERM and SIGHUP). Its command line carries the test's mark.
_SLEEPER = ("import os, signal, sys, time\nif 'handle' in sys.argv:\n"
            "    signal.signal(signal.SIGTERM, lambda *_: None)\n    signal.signal(signal.SIGHUP, lambda *_: None)\n"
            "x = b'x' * (16 << 20)\nprint('alive', flush=True)\nos.write(int(sys.argv[1]), b'1')\ntime.sleep(60)\n")

#: What each program does before its main process ends (or, for the first two, instead of ending).
_ESCAPES = {
    "sleeps": "sleeper()",
    "setsid_then_sleeps": "os.setsid()\nsleeper()",
    "setsid_child": "if os.fork() == 0:\n    os.setsid()\n    sleeper()\nos.read(r, 1)",
    "double_fork_daemon": ("if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        sleeper()\n"
                           "    os._exit(0)\nos.read(r, 1)"),
    "ignores_sigterm_and_sighup": ("if os.fork() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                   "    signal.signal(signal.SIGHUP, signal.SIG_IGN)\n    os.setpgid(0, 0)\n"
                                   "    sleeper()\nos.read(r, 1)"),
    "handles_sigterm_in_a_new_session": "if os.fork() == 0:\n    os.setsid()\n    sleeper('handle')\nos.read(r, 1)",
    "forks_many": ("n = 0\nfor _ in range(5):\n    try:\n        if os.fork() == 0:\n            sleeper()\n"
                   "        n += 1\n    except OSError:\n        break\nfor _ in range(n):\n    os.read(r, 1)"),
    "kills_its_supervisor": ("if os.fork() == 0:\n    os.setsid()\n    sleeper()\nos.read(r, 1)\n"
                             "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(60)"),
}


def _program(body: str, mark: str) -> str:
    return (f"import os, signal, sys, time\nMARK = {mark!r}\nr, w = os.pipe2(0)\n"
            f"def sleeper(*flags):\n"
            f"    os.execv(sys.executable, [sys.executable, '-I', '-S', '-c', {_SLEEPER!r}, str(w), MARK, *flags])\n"
            f"{body}\n")


def _processes_marked(mark: str) -> list[tuple[int, int]]:
    """``(pid, resident KiB)`` of every process on the host whose command line holds ``mark``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if mark.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
        found.append((int(pid), rss))
    return found


def _isolation_params():
    no_ns = pytest.mark.skipif(not NS_OK, reason=f"namespaces not permitted here: {NS_WHY}")
    return [pytest.param("namespaces", marks=no_ns), "none-cgroup", "none-sweep"]


@pytest.fixture(params=_isolation_params())
def isolation(request, monkeypatch):
    """``namespaces``; ``none`` with a cgroup per call (skipped where the trainer may not create cgroups);
    ``none`` with the supervisor's process-tree sweep only (no cgroup)."""
    import polyrl.tools.sandbox as sandbox

    if request.param == "none-cgroup" and sandbox.cgroup_base() is None:
        pytest.skip("this process may not create cgroup v2 groups")
    if request.param == "none-sweep":
        monkeypatch.setattr(sandbox, "_CGROUP_BASE", None)
    return request.param


@pytest.mark.parametrize("escape", sorted(_ESCAPES))
def test_no_process_of_a_call_outlives_it(isolation, escape):
    """Whatever the program does (leave its process group or session, daemonise, ignore or handle SIGTERM and
    SIGHUP, fork many times, kill its supervisor, never end), no process it started exists once the call has
    returned, and none holds its memory."""
    if escape == "kills_its_supervisor" and isolation == "none-sweep":
        pytest.skip("without namespaces or a cgroup, a program that kills its supervisor can escape "
                    "(documented in docs/agents.md)")
    import uuid

    mark = f"polyrl-escape-{uuid.uuid4().hex}"
    box = Sandbox(SandboxLimits(timeout_s=2, cpu_s=5, memory_mb=256, max_processes=12),
                  isolation="namespaces" if isolation == "namespaces" else "none")
    r = box.run(_program(_ESCAPES[escape], mark))
    left = _processes_marked(mark)
    assert "alive" in r.stdout, (r, "the program did not get to start its process: the test proves nothing")
    assert left == [], f"{escape}: processes of the call still run after it returned (pid, RSS KiB): {left}"
    if escape in ("sleeps", "setsid_then_sleeps", "kills_its_supervisor"):
        assert r.timed_out and r.limit == "wall"
    else:
        assert r.ok, r  # the main process ended by itself; what it left behind was ended with it


# ---------------------------------------------------------------------- what happened, reported as it happened

@pytest.fixture(params=[pytest.param("namespaces", marks=needs_ns), "none"])
def any_box(request):
    # wall time to spare: on a busy machine a program gets its 1 CPU second in far more than 1 s of wall time
    return Sandbox(SandboxLimits(timeout_s=30, cpu_s=1, memory_mb=256, max_output_bytes=100),
                   isolation=request.param)


def test_the_programs_own_exit_status_is_reported_as_such(any_box):
    r = any_box.run("import sys\nprint('done')\nsys.exit(152)")  # 152 = 128 + SIGXCPU, from the program
    assert r.returncode == 152 and r.error is None and r.signal is None and r.limit is None
    assert r.stdout == "done\n" and r.describe() == "exited with status 152"


def test_output_that_looks_like_the_sandboxs_own_messages_is_kept(any_box):
    r = any_box.run("print('unshare: sigprocmask unblock failed: Invalid argument')\nraise SystemExit(1)")
    assert r.stdout == "unshare: sigprocmask unblock failed: Invalid argument\n"
    assert r.returncode == 1 and r.error is None and r.signal is None


def test_signals_and_limits_are_told_apart(any_box):
    r = any_box.run("import os, signal\nprint('x', end='', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    assert r.signal == signal.SIGKILL and r.limit is None and r.error == "killed by signal SIGKILL"
    assert r.stdout == "x"
    r = any_box.run("print('spinning', flush=True)\nwhile True:\n    pass")
    assert r.signal == signal.SIGXCPU and r.limit == "cpu" and "CPU time limit of 1 s" in r.error
    assert r.stdout == "spinning\n" and r.metrics["cpu_s"] >= 0.5  # read back just under the limit at times (0.89 s)
    short = Sandbox(SandboxLimits(timeout_s=1, cpu_s=1, memory_mb=256), isolation=any_box.isolation)
    r = short.run("import time\nprint('waiting', flush=True)\ntime.sleep(30)")
    assert r.timed_out and r.limit == "wall" and r.returncode is None and r.stdout == "waiting\n"
    r = any_box.run("print('big')\nx = bytearray(2 << 30)")
    assert r.limit == "memory" and r.returncode == 1 and "MemoryError" in r.stdout and "256 MiB" in r.error


def test_the_program_holds_no_descriptor_of_the_supervisor_and_cannot_forge_its_verdict(any_box):
    """Issue 47: the program inherited fd 4, the write end of the supervisor's report pipe, and could write
    'MemoryError' into it to be reported as having hit the memory limit."""
    r = any_box.run("import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))")
    fds = eval(r.stdout)
    assert r.ok and set(fds) - {0, 1, 2} <= {max(fds)}, r.stdout  # only stdio and the listing's own descriptor
    forged = ("import os, sys\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'MemoryError')\n"
              "    except OSError:\n        pass\nsys.exit(1)")
    r = any_box.run(forged)
    assert r.returncode == 1 and r.limit is None and r.error is None, r


def test_output_at_the_limit_is_whole_and_longer_output_keeps_both_ends(any_box):
    r = any_box.run("import sys\nsys.stdout.write('y' * 100)")  # exactly max_output_bytes, no newline
    assert r.ok and r.stdout == "y" * 100 and not r.truncated and r.dropped_bytes == 0
    r = any_box.run("import sys\nprint('start')\nprint('m' * 1000)\nprint('the end')\nsys.exit(4)")
    assert r.returncode == 4 and r.truncated and r.error is None and r.limit is None
    assert r.stdout.startswith("start\n") and r.stdout.endswith("m\nthe end\n")
    assert r.dropped_bytes == len("start\n") + 1001 + len("the end\n") - 100
    assert f"[{r.dropped_bytes} bytes of output dropped]" in r.stdout and "output truncated" in r.describe()
    r = any_box.run("print('start')\nprint('m' * 1000)\nraise ValueError('the end')")  # the traceback survives
    assert r.returncode == 1 and r.stdout.startswith("start\n") and r.stdout.endswith("ValueError: the end\n")


def test_output_written_just_before_exit_or_by_a_child_is_kept(any_box):
    for _ in range(3):
        r = any_box.run("import os, sys\nsys.stdout.write('last words')\nsys.stdout.flush()\nos._exit(3)")
        assert r.returncode == 3 and r.stdout == "last words" and r.error is None
    r = any_box.run("import os\nif os.fork() == 0:\n    print('child', flush=True)\n    os._exit(0)\n"
                    "os.wait()\nprint('parent')")
    assert r.ok and r.stdout == "child\nparent\n"


def test_the_python_tool_gives_the_output_and_how_the_run_ended():
    tool = PythonTool({"timeout_s": 3, "cpu_s": 1, "memory_mb": 256, "max_output_bytes": 100, "isolation": "none"})
    with pytest.raises(RuntimeError) as err:
        asyncio.run(tool.execute({"code": "print('partial result')\nimport sys\nsys.exit(152)"}, {}))
    assert str(err.value) == "partial result\n[exited with status 152]"
    out = asyncio.run(tool.execute({"code": "print('a' * 300)"}, {}))
    assert out.text.startswith("a" * 50) and out.text.endswith("[output truncated: 201 bytes dropped from its middle]")
