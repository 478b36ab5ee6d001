"""Split placement's weight sync: ``trainer.weight_transfer=collective`` against ``object_store``.

One actor worker and one rollout worker (``trainer.placement=split``) on a local Ray, for each model size;
the same groups time ``--repeats`` syncs (``RoleGroups.sync_weights``, as the trainer calls it once per
step) through each path, alternating, after one untimed sync of each. Reports the median seconds per sync
and the bytes moved. On CPU the collective path is gloo over loopback TCP; on GPUs it is NCCL.
See docs/placement.md (the numbers there come from this script).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_transfer.py [--sizes tiny mini small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bench_size(size: str, root: Path, args: argparse.Namespace) -> dict:
    """Median seconds per sync of each path for a ``make_tiny_model(size=...)`` model."""
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.models.tiny import make_tiny_model
    from polyrl.plugins import activate
    from polyrl.trainer.role_groups import build_role_groups
    from polyrl.trainer.weight_sync import ObjectStoreWeightSync

    model = make_tiny_model(root / size, size=size, seed=0)
    manifest = Manifest.from_dict({"plugins": {"require": ["polyrl-engine-fsdp>=0.1,<0.2"]}})
    pm = activate(manifest)
    config = load_config(PolyrlConfig, [], [
        f"model.path={model}", "actor.engine=fsdp", "trainer.executor=ray", "trainer.placement=split",
        "trainer.n_workers=1", "trainer.rollout_workers=1", "trainer.ray_num_cpus=2",
        "trainer.weight_transfer=collective", f"trainer.device={args.device}", f"trainer.run_dir={root / 'run'}",
        f"trainer.weight_bucket_mb={args.bucket_mb}"], plugins=pm)
    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=root / "run")
    collective = groups.weight_sync
    try:
        nbytes = sum(p.numel() * p.element_size() for p in _params(model))
        times: dict[str, list[float]] = {"object_store": [], "collective": []}
        for i in range(args.repeats + 1):
            for mode in times:
                by_store = ObjectStoreWeightSync(groups.actor, groups.rollout)
                groups.weight_sync = collective if mode == "collective" else by_store
                start = time.perf_counter()
                groups.sync_weights()
                if i:  # the first round sets up the weight group and warms both paths
                    times[mode].append(time.perf_counter() - start)
    finally:
        groups.shutdown()
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"size": size, "mib": nbytes / 2**20, **{f"{m}_s": v for m, v in med.items()},
            "collective_over_object_store": med["collective"] / med["object_store"]}


def _params(model: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        yield from AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "mini", "small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bwt-", dir="/tmp") as tmp:
        for size in args.sizes:
            print(json.dumps(bench_size(size, Path(tmp), args)), flush=True)


if __name__ == "__main__":
    main()
