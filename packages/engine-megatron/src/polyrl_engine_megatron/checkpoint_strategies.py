"""How the megatron engine writes and reads megatron-core ``dist_checkpointing`` folders (``torch_dist`` format).

Saving: megatron's own format, written synchronously by torch's ``FileSystemWriter`` (megatron's default
writer forks writer processes and spawns a multiprocessing manager per save, which re-imports the main module
of the process: a Ray worker, a test runner); the files are the same.

Loading runs no code from the folder. megatron-core's default load strategies unpickle three things without
restrictions: the DCP ``.metadata`` (torch's ``FileSystemReader``), ``common.pt`` (``torch.load``) and each
sharded object (DCP's ``load_bytes``). :func:`safe_load_strategies` returns strategies that read all three
through :func:`polyrl.checkpoint_io.load_dcp` and :func:`~polyrl.checkpoint_io.load_tensors`: the metadata through its allow-list, ``common.pt`` and every object with
``weights_only=True``. Anything else is a :class:`~polyrl.errors.CheckpointError` naming the file or item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyrl.checkpoint_io import load_dcp, load_tensors, read_dcp_metadata

COMMON_FILE = "common.pt"


def sync_save_strategy() -> Any:
    """megatron's ``torch_dist`` save strategy, written synchronously by torch's plain ``FileSystemWriter``."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class _SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(state, False),
                     storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(flatten_state_dict=False))

    return _SyncTorchDistSave("torch_dist", 1)


def safe_load_strategies() -> tuple[Any, Any]:
    """``(sharded_strategy, common_strategy)`` for ``dist_checkpointing.load`` that unpickle nothing but plain
    data: every metadata read goes through :func:`polyrl.checkpoint_io.read_dcp_metadata`, every object
    through ``weights_only=True``."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        TorchDistLoadShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    class _PlainDataCommonLoad(TorchCommonLoadStrategy):
        """``common.pt`` and per-object files with ``weights_only=True``."""

        def load_common(self, checkpoint_dir: str | Path) -> Any:
            return load_tensors(Path(checkpoint_dir) / COMMON_FILE)

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
            def load(sh_obj: Any) -> Any:
                return load_tensors(Path(checkpoint_dir) / f"{sh_obj.unique_key}.pt")

            return dict_list_map_inplace(load, sharded_objects_state_dict)

        def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
            raise NotImplementedError("polyrl reads sharded objects through the torch_dist strategy")

    class _PlainDataTorchDistLoad(TorchDistLoadShardedStrategy):
        """megatron's ``torch_dist`` load, through polyrl's allow-listed reader and plain-data planner."""

        def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
            # the same translation megatron's strategy makes (MCore sharded tensors <-> PyT ones), with the
            # reader and planner swapped for the safe ones
            to_validate = [t for t in nested_values(sharded_state_dict)
                           if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
            mismatch_ok = {t.key: t for t in nested_values(sharded_state_dict)
                           if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
            template = sharded_state_dict
            flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
            pyt_state = mcore_to_pyt_state_dict(flat, True)
            planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=to_validate,
                                       allow_shape_mismatch_sharded_tensors=mismatch_ok)
            load_dcp(pyt_state, checkpoint_dir, planner=planner)
            restored = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state.items()}
            restored = _replace_sharded_keys_with_state_dict_keys(restored, flat_mapping, rename_mapping)
            _restore_dict_types(restored, template)
            return restored

        def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
            return super().load_tensors_metadata(checkpoint_dir, metadata or read_dcp_metadata(checkpoint_dir))

        def load_sharded_metadata(self, checkpoint_dir: Path) -> Any:
            metadata = read_dcp_metadata(checkpoint_dir)
            found: dict[str, Any] = {}
            for key, storage in metadata.state_dict_metadata.items():
                if isinstance(storage, BytesStorageMetadata):
                    obj = ShardedObject.empty_from_unique_key(key)
                    found[obj.unique_key] = obj
            found.update(self.load_tensors_metadata(checkpoint_dir, metadata))
            return found

    return _PlainDataTorchDistLoad(), _PlainDataCommonLoad()
