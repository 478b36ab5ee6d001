"""Split placement's collective weight transfer against the object-store path, on a real local Ray."""

from __future__ import annotations


def test_collective_weight_transfer_matches_the_object_store(base_overrides, manifest_file, tmp_path):
    """Split placement: the rollout weights after a collective sync are bit-identical to
    those after an object-store sync (and to the actor's), whatever the rollout held before."""
    import ray
    import torch

    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.trainer.commands import _plugins
    from polyrl.trainer.role_groups import build_role_groups
    from polyrl.trainer.weight_sync import CollectiveWeightSync, ObjectStoreWeightSync

    manifest, pm = _plugins(manifest_file)
    config = load_config(PolyrlConfig, [], base_overrides + [
        "trainer.executor=ray", "trainer.placement=split", "trainer.rollout_workers=1", "trainer.ray_num_cpus=2",
        "trainer.weight_transfer=collective", "trainer.device=cpu"], plugins=pm)
    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=tmp_path / "run")
    try:
        assert isinstance(groups.weight_sync, CollectiveWeightSync)

        def scramble(worker, seed):
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in worker.rollout.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))

        def rollout_state(worker):
            return {k: v.detach().clone() for k, v in worker.rollout.model.state_dict().items()}

        def actor_weights(worker):
            return {n: t.detach().clone() for b in worker.actor.weights_for_rollout(1 << 20) for n, t in b}

        def states():
            return ray.get([w.__ray_call__.remote(rollout_state) for w in groups.rollout.workers])

        collective = groups.weight_sync
        results = {}
        for mode in ("object_store", "collective"):
            ray.get([w.__ray_call__.remote(scramble, i) for i, w in enumerate(groups.rollout.workers)])
            scrambled = states()
            by_store = ObjectStoreWeightSync(groups.actor, groups.rollout)
            groups.weight_sync = collective if mode == "collective" else by_store
            groups.sync_weights()
            results[mode] = states()
            assert any(not torch.equal(scrambled[0][k], results[mode][0][k]) for k in scrambled[0]), mode
        actor = ray.get(groups.actor.workers[0].__ray_call__.remote(actor_weights))
        for by_store, by_group in zip(results["object_store"], results["collective"], strict=True):
            assert by_store.keys() == by_group.keys()
            for key in by_store:
                assert by_group[key].dtype == by_store[key].dtype and torch.equal(by_group[key], by_store[key]), key
            for name, tensor in actor.items():
                assert torch.equal(by_group[name], tensor.to(by_group[name].dtype)), name
    finally:
        groups.shutdown()
