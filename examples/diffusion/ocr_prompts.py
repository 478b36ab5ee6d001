"""Make an OCR-style prompt set (text rendering, as in Flow-GRPO's OCR task and verl's ``qwenimage_ocr.py``),
offline, as parquet (or jsonl) rows for ``trainer.name=flow_grpo`` with the ``ocr`` reward.

    python examples/diffusion/ocr_prompts.py --out data/ocr --train 512 --val 64
    python examples/diffusion/ocr_prompts.py --out data/ocr --texts my_texts.txt   # one target text per line
    python examples/diffusion/ocr_prompts.py --out data/ocr --texts flow_grpo/dataset/ocr/train.txt  # whole prompts

Each row::

    {"data_source": "ocr", "prompt": [{"role": "user", "content": 'a shop sign that says "amber river"'}],
     "negative_prompt": "blurry, distorted letters, low quality", "ability": "text_to_image",
     "reward_model": {"style": "rule", "ground_truth": "amber river"}, "extra_info": {"split": ..., "index": i}}

Without ``--texts`` the texts are random words from a built-in list (seeded: the same command writes
the same files). A ``--texts`` line with double quotes is a whole prompt, as in Flow-GRPO's ``dataset/ocr/*.txt``
(a scene description with the text to render in quotes): it stays the prompt and its quoted text is the ground
truth. Any other line is a target text, put in a random OCR template. (``data.train_files`` also takes Flow-GRPO's
``.txt`` files as they are: docs/diffusion.md, "Prompt data".) The ``ocr`` reward scores an image by ``1 - normalised edit distance`` between the
text RapidOCR reads in it and ``ground_truth`` (docs/diffusion.md, "Rewards").
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from polyrl_diffusion.data import OCR_TEMPLATES, ocr_rows, prompt_row, write_rows
from polyrl_diffusion.rewards import quoted_text


def rows_from_texts(texts: list[str], *, split: str, seed: int, negative_prompt: str | None) -> list[dict]:
    """A row per line of ``texts``: a line with a quoted text is a whole prompt (Flow-GRPO's OCR files) whose
    ground truth is the quoted text; any other line is the ground truth itself, in a random OCR template."""
    rng = random.Random(seed)
    rows = []
    for i, line in enumerate(texts):
        line = line.strip()
        if line.count('"') >= 2:
            prompt, text = line, quoted_text(line)
        else:
            text = line
            prompt = rng.choice(OCR_TEMPLATES).format(text=text)
        rows.append(prompt_row(prompt, index=i, data_source="ocr", negative_prompt=negative_prompt,
                               ground_truth=text, split=split))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/ocr", help="output folder (train/val files go there)")
    parser.add_argument("--train", type=int, default=512, help="training prompts (random words)")
    parser.add_argument("--val", type=int, default=64, help="validation prompts (random words)")
    parser.add_argument("--texts", help="a text file, one target text or one whole prompt with the text in double "
                                        "quotes per line (Flow-GRPO's dataset/ocr/*.txt); replaces the random "
                                        "words; the last --val lines become the validation set")
    parser.add_argument("--negative-prompt", default="blurry, distorted letters, low quality")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    negative = args.negative_prompt or None
    if args.texts:
        texts = [t for t in Path(args.texts).expanduser().read_text(encoding="utf-8").splitlines() if t.strip()]
        if len(texts) <= args.val:
            raise SystemExit(f"--texts {args.texts} has {len(texts)} texts; more than --val={args.val} are needed")
        train = rows_from_texts(texts[: len(texts) - args.val], split="train", seed=args.seed,
                                negative_prompt=negative)
        val = rows_from_texts(texts[len(texts) - args.val :], split="test", seed=args.seed + 1,
                              negative_prompt=negative)
    else:
        train = ocr_rows(args.train, seed=args.seed, split="train", negative_prompt=negative)
        val = ocr_rows(args.val, seed=args.seed + 10_000, split="test", negative_prompt=negative)
    for name, rows in (("train", train), ("val", val)):
        path = write_rows(rows, out / f"{name}.{args.format}")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
