"""Datasets in verl's row format: loading, validation, chat templates, a resumable loader.

A row::

    {"prompt": [{"role": "user", "content": "..."}], "data_source": "gsm8k",
     "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {...},
     "agent_name": "single_turn"}   # optional
"""

from polyrl.data.dataset import RLDataLoader, RLDataset, load_rows, validate_row

__all__ = ["RLDataLoader", "RLDataset", "load_rows", "validate_row"]
