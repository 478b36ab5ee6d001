"""Placement helpers of the trainer."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from polyrl.trainer.role_groups import _RAY_SOCKET_SUFFIX, _UNIX_SOCKET_MAX, ray_temp_dir


def test_ray_temp_dir_is_under_the_run_dir_when_it_fits():
    short = Path(tempfile.mkdtemp(prefix="p"))  # pytest's tmp_path is itself too deep
    try:
        run = short / "r"
        assert ray_temp_dir(run) == run / "ray" and (run / "ray").is_dir()
    finally:
        shutil.rmtree(short)


def test_ray_temp_dir_of_a_deep_run_dir_keeps_socket_paths_short(tmp_path):
    run = tmp_path.joinpath(*(["deeply-nested-folder"] * 4))
    chosen = ray_temp_dir(run)
    try:
        assert chosen != run / "ray" and chosen.is_dir()
        assert len(str(chosen).encode()) + _RAY_SOCKET_SUFFIX <= _UNIX_SOCKET_MAX
    finally:
        shutil.rmtree(chosen)
