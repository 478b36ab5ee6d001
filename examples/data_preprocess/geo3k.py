"""Turn Geometry3K (``hiyouga/geometry3k``: images, problem, answer) into polyrl/verl rows with images, as parquet.

    python examples/data_preprocess/geo3k.py --input geometry3k/train.parquet --output data/geo3k/train.parquet

``--input`` is a local copy of the dataset in its own format (parquet or jsonl with ``images``, ``problem``
and ``answer`` columns; download it yourself where the Hub is reachable, e.g. ``datasets.load_dataset(
"hiyouga/geometry3k")["train"].to_parquet(...)``). A problem's ``<image>`` marks where its figure goes
(add one at the start if it has none). Each row becomes::

    {"prompt": [{"role": "user", "content": PROBLEM + " " + INSTRUCTION}], "images": [{"bytes": ..., "path": ...}],
     "data_source": "hiyouga/geometry3k", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": ANSWER}, "extra_info": {"split": ..., "index": i, ...}}

The images stay inside the parquet file (their bytes), as the dataset stores them. The built-in ``geo3k``
reward scores these rows (``0.9 * acc + 0.1 * format``; docs/rewards_and_data.md). See docs/vlm.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: The instruction verl's geo3k preprocessing appends (kept word for word, so results compare with verl's).
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
DATA_SOURCE = "hiyouga/geometry3k"


def _image(entry: Any, i: int) -> dict:
    """One image as parquet stores it (``{"bytes": ..., "path": ...}``); a path string is kept as a path."""
    if isinstance(entry, dict) and (entry.get("bytes") is not None or entry.get("path")):
        return {"bytes": entry.get("bytes"), "path": entry.get("path")}
    if isinstance(entry, str):
        return {"bytes": None, "path": entry}
    raise ValueError(f"row {i}: an image must be {{'bytes': ..., 'path': ...}} or a path, got {type(entry).__name__}")


def convert(rows: list[dict], split: str) -> list[dict]:
    """Geometry3K rows -> polyrl rows (one ``<image>`` placeholder per image in the prompt)."""
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in ("images", "problem", "answer") if k not in row]
        if missing:
            raise ValueError(f"row {i}: Geometry3K rows need 'images', 'problem' and 'answer'; missing {missing}")
        images = [_image(e, i) for e in (row["images"] or [])]
        problem = str(row["problem"])
        if images and "<image>" not in problem:
            problem = "<image>" * len(images) + problem
        if problem.count("<image>") != len(images):
            raise ValueError(f"row {i}: the problem has {problem.count('<image>')} <image> placeholders for "
                             f"{len(images)} images")
        out.append({
            "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
            "images": images,
            "data_source": DATA_SOURCE,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(row["answer"])},
            "extra_info": {"split": split, "index": i, "answer": str(row["answer"]), "question": str(row["problem"])},
        })
    return out


def read(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = convert(read(args.input), args.split)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.output)
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
