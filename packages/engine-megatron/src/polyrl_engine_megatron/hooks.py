"""polyrl hooks of the megatron-core engine plugin.

Imports nothing heavy: megatron-core loads only when a run selects engine ``megatron``.
"""

from polyrl import hookimpl


@hookimpl
def register_engines(register):
    register("megatron", "polyrl_engine_megatron.engine:MegatronEngine",
             description="megatron-core GPTModel with tensor, pipeline and data parallelism (actor, reference, critic)")


@hookimpl
def register_config_schemas(register):
    register("engine.megatron", "polyrl_engine_megatron.config:MegatronConfig")
