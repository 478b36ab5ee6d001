"""Datasets in verl's row format: loading, validation, chat templates, a resumable loader.

A row::

    {"prompt": [{"role": "user", "content": "..."}], "data_source": "gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {...},
     "agent_name": "single_turn"}   # optional
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.data.dataset import RLDataLoader, RLDataset, load_rows, validate_row

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "RLDataLoader": "polyrl.data.dataset",
    "RLDataset": "polyrl.data.dataset",
    "load_rows": "polyrl.data.dataset",
    "validate_row": "polyrl.data.dataset",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = ["RLDataLoader", "RLDataset", "load_rows", "validate_row"]
