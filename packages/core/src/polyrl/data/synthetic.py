"""Synthetic tasks in verl's row format, for the quickstarts, tests and benchmarks: arithmetic (text) and
coloured shapes drawn with PIL (vision-language)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def make_arithmetic_rows(n: int, *, seed: int = 0, max_operand: int = 20, ops: str = "+") -> list[dict]:
    """``n`` rows like ``{"prompt": [{"role": "user", "content": "12+7="}], "reward_model": {"ground_truth": "19"}}``.

    ``data_source`` is ``arithmetic`` (scored by the built-in ``arithmetic`` reward function).
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "data_source": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i, "a": a, "b": b, "op": op},
        })
    return rows


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


#: The shapes task's colours (RGB) and shapes; answers are these words.
SHAPE_COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
#: The two questions of the shapes task, by what they ask.
SHAPE_QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}


def draw_shape(colour: str, shape: str, *, size: int = 56, rng: random.Random | None = None) -> Any:
    """A ``size`` x ``size`` RGB PIL image: one ``shape`` of ``colour`` (keys of :data:`SHAPE_COLOURS`,
    :data:`SHAPES`) at a random place and size on a light grey background."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    img = Image.new("RGB", (size, size), (235, 235, 235))
    draw = ImageDraw.Draw(img)
    side = rng.randint(size * 2 // 5, size * 3 // 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    fill = SHAPE_COLOURS[colour]
    if shape == "circle":
        draw.ellipse([x, y, x + side - 1, y + side - 1], fill=fill)
    elif shape == "square":
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=fill)
    elif shape == "triangle":
        draw.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    else:
        raise ValueError(f"shape={shape!r}: choose one of {', '.join(SHAPES)}")
    return img


def make_shape_rows(n: int, image_dir: str | Path, *, seed: int = 0, questions: Sequence[str] = ("colour", "shape"),
                    colours: Sequence[str] = tuple(SHAPE_COLOURS), shapes: Sequence[str] = SHAPES,
                    size: int = 56) -> list[dict]:
    """``n`` rows of a visual task in verl's format, with their images written as PNGs into ``image_dir``.

    Each image shows one coloured shape (:func:`draw_shape`); the prompt asks for its colour or its shape
    (``questions``: keys of :data:`SHAPE_QUESTIONS`), so only the image holds the answer::

        {"prompt": [{"role": "user", "content": "<image>What colour is the shape?"}], "images": [".../3.png"],
         "data_source": "shapes", "reward_model": {"style": "rule", "ground_truth": "red"}, ...}

    Scored by the built-in ``shapes`` reward function (exact answer word).
    """
    rng = random.Random(seed)
    folder = Path(image_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour, shape, question = rng.choice(list(colours)), rng.choice(list(shapes)), rng.choice(list(questions))
        path = folder / f"{seed}_{i}.png"
        draw_shape(colour, shape, size=size, rng=rng).save(path)
        rows.append({
            "prompt": [{"role": "user", "content": "<image>" + SHAPE_QUESTIONS[question]}],
            "images": [str(path)],
            "data_source": "shapes",
            "reward_model": {"style": "rule", "ground_truth": colour if question == "colour" else shape},
            "extra_info": {"index": i, "colour": colour, "shape": shape, "question": question},
        })
    return rows
