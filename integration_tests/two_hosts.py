"""Two hosts on one machine: two network namespaces with their own addresses, a Ray cluster started on them the
way docs/cluster.md says (``ray start --head`` on one, ``ray start --address=HEAD:6379`` on the other).

Each namespace is a host: its own network stack, a veth link between the two (``eth49`` on both sides, addresses
``10.249.<n>.1`` and ``10.249.<n>.2``), nothing else reachable. Processes keep the machine's file system and
Python, as the hosts of a real cluster share an image. Everything the harness starts runs inside the namespaces,
and teardown ends exactly those processes (by pid: ``ip netns pids``) and deletes the namespaces, whatever
happened. Needs root (``ip netns add``); :func:`namespaces_refused` says why not where it is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: The interface name inside both namespaces (gloo is told to use it: GLOO_SOCKET_IFNAME).
IFNAME = "eth49"
BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_refused() -> str | None:
    """``None`` when this process may make network namespaces, else why not (one line)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    name = f"p49probe{os.getpid()}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` refused: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class TwoHosts:
    """``with TwoHosts(tmp) as hosts:`` host ``a`` (the head, ``hosts.head``) and host ``b``, Ray running on both."""

    def __init__(self, tmp: Path, *, cpus: tuple[int, int] = (1, 2)) -> None:
        tag = f"{os.getpid() % 100000}"
        self.net = 1 + os.getpid() % 250
        self.ns = {"a": f"p49a{tag}", "b": f"p49b{tag}"}
        self.ip = {"a": f"10.249.{self.net}.1", "b": f"10.249.{self.net}.2"}
        self.cpus = dict(zip("ab", cpus))
        self.tmp = tmp
        # Ray's socket paths must stay short (107 bytes)
        self.temp = {h: Path(f"/tmp/p49{h}{tag}") for h in "ab"}
        self.head = f"{self.ip['a']}:6379"
        self.old_temps: list[Path] = []
        self.env = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME,
                        TOKENIZERS_PARALLELISM="false", PATH=f"{BIN}:{os.environ.get('PATH', '')}",
                        # the machine's memory is shared with whatever else runs here: Ray's monitor would kill
                        # these hosts' workers for other processes' memory
                        RAY_memory_monitor_refresh_ms="0")
        self.env.pop("RAY_ADDRESS", None)

    # ------------------------------------------------------------------ set-up and teardown
    def __enter__(self) -> TwoHosts:
        try:
            self._make_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_network(self) -> None:
        for h in "ab":
            _ip("netns", "add", self.ns[h])
        a, b = f"p49x{self.net}", f"p49y{self.net}"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for h, end in (("a", a), ("b", b)):
            _ip("link", "set", end, "netns", self.ns[h])
            _ip("-n", self.ns[h], "link", "set", end, "name", IFNAME)
            _ip("-n", self.ns[h], "addr", "add", f"{self.ip[h]}/24", "dev", IFNAME)
            _ip("-n", self.ns[h], "link", "set", IFNAME, "up")
            _ip("-n", self.ns[h], "link", "set", "lo", "up")

    def _start_ray(self) -> None:
        self.check("a", ["ray", "start", "--head", "--port=6379", f"--node-ip-address={self.ip['a']}",
                         f"--num-cpus={self.cpus['a']}", "--num-gpus=0", f"--temp-dir={self.temp['a']}",
                         "--disable-usage-stats", "--include-dashboard=false"])
        self.join("b")
        self.wait_nodes(2)

    def join(self, host: str) -> None:
        """``ray start --address=HEAD:6379`` on ``host`` (again, after :meth:`kill_host`: a fresh temp dir)."""
        temp = self.temp[host]
        if temp.exists():  # the killed node's files stay behind, as on a machine that rebooted
            temp = self.temp[host] = Path(f"{temp}r")
            self.old_temps.append(temp)
        self.check(host, ["ray", "start", f"--address={self.head}", f"--node-ip-address={self.ip[host]}",
                          f"--num-cpus={self.cpus[host]}", "--num-gpus=0", f"--temp-dir={temp}",
                          "--disable-usage-stats"])

    def wait_nodes(self, count: int, timeout: float = 60) -> None:
        """Until the head counts ``count`` alive nodes."""
        code = ("import sys, time, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); deadline = time.time() "
                "+ float(sys.argv[3])\nwhile sum(n['Alive'] for n in ray.nodes()) != int(sys.argv[2]):\n"
                "    assert time.time() < deadline, ray.nodes()\n    time.sleep(0.2)")
        self.check("a", [sys.executable, "-c", code, self.head, str(count), str(timeout)])

    def close(self) -> None:
        """End every process of both namespaces (by pid) and delete them; nothing outside them is touched."""
        for h in "ab":
            self.kill_host(h)
        for h in "ab":
            _ip("netns", "del", self.ns[h], check=False)
            shutil.rmtree(self.temp[h], ignore_errors=True)
        for temp in self.old_temps:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(str(temp)[:-1], ignore_errors=True)

    # ------------------------------------------------------------------ processes on a host
    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def check(self, host: str, argv: list[str], timeout: float = 120) -> str:
        proc = subprocess.run(self.command(host, argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} on host {host} failed: {proc.stderr[-2000:]}")
        return proc.stdout

    def start(self, host: str, argv: list[str], **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kwargs)  # type: ignore[call-overload]

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.ns[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: str) -> int:
        """SIGKILL every process of ``host`` (what a lost machine looks like); how many there were."""
        killed = 0
        for _ in range(5):  # a process may start another while we kill
            pids = self.pids(host)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        return killed
