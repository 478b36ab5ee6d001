"""A local Ray per controller test module (worker classes are imported by the workers from this folder)."""

from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = tempfile.mkdtemp(prefix="polyrl-controller-")
    here = os.path.dirname(__file__)  # the workers import the test modules to build their worker classes
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old or "") if p)
    ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
