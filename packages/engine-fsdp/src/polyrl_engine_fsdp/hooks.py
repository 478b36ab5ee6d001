"""polyrl hooks of the FSDP engine plugin. Imports nothing heavy: the engine loads when a run selects it."""

from polyrl import hookimpl


@hookimpl
def register_engines(register):
    register("fsdp", "polyrl_engine_fsdp.engine:FSDPEngine", aliases=["fsdp2"],
             description="FSDP2 over transformers models (actor, reference, critic; LoRA via peft)")


@hookimpl
def register_config_schemas(register):
    register("engine.fsdp", "polyrl_engine_fsdp.config:FSDPConfig")
