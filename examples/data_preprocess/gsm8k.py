"""Turn GSM8K (question / answer with '#### N') into polyrl/verl rows, as parquet.

verl's spelling (the same flags as verl's ``examples/data_preprocess/gsm8k.py``; writes ``train.parquet`` and
``test.parquet``)::

    python examples/data_preprocess/gsm8k.py --local_dataset_path ~/gsm8k --local_save_dir ~/data/gsm8k

``--local_dataset_path`` is a local copy of GSM8K: a folder holding ``train.jsonl`` and ``test.jsonl`` (OpenAI's
grade-school-math files) or ``train.parquet`` and ``test.parquet``, or a snapshot of the hub dataset
``openai/gsm8k`` (``main/train-*.parquet``, ``main/test-*.parquet``). Without it the hub dataset is read with the
``datasets`` library, where a hub is reachable. ``--local_dir`` is verl's deprecated name of ``--local_save_dir``.

One file at a time::

    python examples/data_preprocess/gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet

Each row becomes (verl's rows, field for field)::

    {"prompt": [{"role": "user", "content": QUESTION + " " + INSTRUCTION}], "data_source": "openai/gsm8k",
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": ..., "index": i, "answer": ..., "question": ...}}
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_solution(answer: str) -> str:
    """The number after ``#### `` in a GSM8K answer, commas removed."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise ValueError(f"GSM8K answer without '#### N': {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def convert(rows: list[dict], split: str) -> list[dict]:
    """GSM8K rows -> polyrl rows."""
    out = []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"row {i}: GSM8K rows need 'question' and 'answer', got {sorted(row)}")
        out.append({
            "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
            "data_source": "openai/gsm8k",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": extract_solution(row["answer"])},
            "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]},
        })
    return out


def read(path: Path) -> list[dict]:
    """The rows of one GSM8K file (``.jsonl``/``.json`` lines or ``.parquet``)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split`` in a local GSM8K folder (see the module docstring for the layouts)."""
    for pattern in (f"{split}.jsonl", f"{split}.parquet", f"main/{split}-*.parquet", f"{split}-*.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    raise SystemExit(f"--local_dataset_path {folder}: no {split}.jsonl, {split}.parquet or main/{split}-*.parquet "
                     "in it; point it at a folder holding GSM8K's train and test files")


def load_splits(local_dataset_path: str | None) -> dict[str, list[dict]]:
    """GSM8K's train and test rows, from a local folder or (without one) the hub dataset ``openai/gsm8k``."""
    if local_dataset_path is not None:
        folder = Path(local_dataset_path).expanduser()
        if not folder.is_dir():
            raise SystemExit(f"--local_dataset_path {folder}: not a folder")
        return {split: [row for f in split_files(folder, split) for row in read(f)] for split in SPLITS}
    try:
        import datasets
    except ImportError:
        raise SystemExit("no --local_dataset_path and no `datasets` library to read openai/gsm8k from the hub: "
                         "pass --local_dataset_path DIR (a folder with GSM8K's train.jsonl and test.jsonl)") from None
    dataset = datasets.load_dataset("openai/gsm8k", "main")
    return {split: list(dataset[split]) for split in SPLITS}


def write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"wrote {len(rows)} rows to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dataset_path", default=None,
                        help="a local copy of GSM8K (a folder); without it, the hub dataset openai/gsm8k")
    parser.add_argument("--local_save_dir", default="~/data/gsm8k", help="where train.parquet and test.parquet go")
    parser.add_argument("--local_dir", default=None, help="deprecated (verl): the same as --local_save_dir")
    parser.add_argument("--hdfs_dir", default=None, help="verl's HDFS copy: not supported")
    parser.add_argument("--input", type=Path, default=None, help="one GSM8K file to convert (with --output)")
    parser.add_argument("--output", type=Path, default=None, help="the parquet file --input becomes")
    parser.add_argument("--split", default="train", help="extra_info.split of --input's rows")
    args = parser.parse_args(argv)
    if args.hdfs_dir is not None:
        parser.error("--hdfs_dir: polyrl does not copy to HDFS; write locally (--local_save_dir) and copy it yourself")
    if (args.input is None) != (args.output is None):
        parser.error("--input and --output go together")
    if args.input is not None:
        write(convert(read(args.input), args.split), args.output)
        return
    save_dir = args.local_save_dir
    if args.local_dir is not None:
        print("--local_dir is deprecated (as in verl): use --local_save_dir", file=sys.stderr)
        save_dir = args.local_dir
    for split, rows in load_splits(args.local_dataset_path).items():
        write(convert(rows, split), Path(save_dir).expanduser() / f"{split}.parquet")


if __name__ == "__main__":
    main()
