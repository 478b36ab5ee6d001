"""Turn GSM8K (question / answer with '#### N') into polyrl/verl rows, as parquet.

    python examples/data_preprocess/gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet

``--input`` is a local copy of GSM8K in its own format (jsonl or parquet with ``question`` and
``answer`` columns; download it yourself where a hub is reachable). Each row becomes::

    {"prompt": [{"role": "user", "content": QUESTION + INSTRUCTION}], "data_source": "openai/gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": ..., "index": i, ...}}
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


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
            "extra_info": {"split": split, "index": i, "question": row["question"], "answer": row["answer"]},
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
