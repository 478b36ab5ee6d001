"""What verifying checkpoints costs: recording and checking ``checkpoint_files.json`` against the save itself.

A torch.distributed.checkpoint of ``--gib`` GiB of float32 tensors (``--files`` shards, as ranks would write)
is saved with DCP's ``FileSystemWriter``; then, alternating over ``--repeats`` rounds, the time of
``polyrl.checkpoint_io.write_file_manifest`` (what every save adds), ``verify_files`` (what a resume or an
export adds) and of a plain read of every file (the floor for anything that looks at every byte). Reports
seconds, GB/s and the ratios to the save and to the plain read. The files stay in the page cache, as they are
right after a save; a resume from a cold disk reads at the disk's speed instead. See docs/checkpoints.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint_verify.py [--gib 1] [--files 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _read_all(folder: Path) -> None:
    buf = bytearray(4 << 20)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main() -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from polyrl.checkpoint_io import verify_files, write_file_manifest

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-ckpt-", dir=args.dir))
    try:
        numel = int(args.gib * (1 << 30) / 4 / args.files)
        state = {f"shard{i}": torch.randn(numel) for i in range(args.files)}
        folder = root / "ck"
        start = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=args.files), no_dist=True)
        save_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        times: dict[str, list[float]] = {"read": [], "manifest": [], "verify": []}
        for _ in range(args.repeats):
            for name, fn in (("read", lambda: _read_all(folder)), ("manifest", lambda: write_file_manifest(folder)),
                             ("verify", lambda: verify_files(folder))):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "bytes": size, "cpus": os.cpu_count(), "save_s": round(save_s, 3),
            **{f"{k}_s": round(v, 3) for k, v in med.items()},
            **{f"{k}_gb_per_s": round(size / v / 1e9, 2) for k, v in med.items()},
            "manifest_over_save": round(med["manifest"] / save_s, 2),
            "verify_over_plain_read": round(med["verify"] / med["read"], 2),
        }
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
