"""A rendezvous port taken between the moment it is picked and the moment rank 0 listens on it (EADDRINUSE,
about one run in thirty on a busy machine): a single process retries on a fresh port, a Ray group is started
again on another port. Real gloo groups; the port is taken by a real listening socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from polyrl.controller.worker_group import RayWorkerGroup


def _occupied() -> socket.socket:
    """A socket listening on a port of 127.0.0.1, as another process would after the driver picked it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_single_process_group_retries_on_a_fresh_port():
    taken = _occupied()
    try:
        port = taken.getsockname()[1]
        code = textwrap.dedent(f"""
            import torch.distributed as dist
            from polyrl.distributed import init_distributed
            init_distributed("gloo", 0, 1, "127.0.0.1", {port})
            import os
            print(dist.get_world_size(), os.environ["MASTER_PORT"])
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-2000:]
        world, used = done.stdout.split()
        assert world == "1" and int(used) != port
    finally:
        taken.close()


class _GlooWorker:
    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        from polyrl.distributed import init_distributed

        init_distributed("gloo", rank, world_size, master_addr, master_port)
        self.port = master_port

    def ready(self) -> bool:
        return True

    def all_reduce(self) -> tuple[float, int]:
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t), self.port

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    here = os.path.dirname(__file__)  # the workers import this module to build _GlooWorker
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old or "") if p)
    ray.init(num_cpus=2, _temp_dir=tempfile.mkdtemp(prefix="polyrl-rdzv-"), include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.mark.timeout(300)
def test_a_ray_group_starts_again_when_its_port_was_taken(ray_local, monkeypatch):
    from polyrl.controller import cluster

    taken = _occupied()
    taken_port = taken.getsockname()[1]
    picked: list[int] = []
    real = cluster.rendezvous_address

    def first_pick_is_taken(nodes):
        address, port = ("127.0.0.1", taken_port) if not picked else real(nodes)
        picked.append(port)
        return address, port

    monkeypatch.setattr(cluster, "rendezvous_address", first_pick_is_taken)
    try:
        group = RayWorkerGroup(_GlooWorker, 2, resources_per_worker={"CPU": 0.5}, name="rdzv", master_port=0)
        try:
            results = group.call_all("all_reduce")
        finally:
            group.shutdown()
    finally:
        taken.close()
    assert len(picked) == 2 and picked[0] == taken_port and picked[1] != taken_port
    assert [r[0] for r in results] == [2.0, 2.0] and {r[1] for r in results} == {picked[1]}
