"""Registers the built-in dataset loaders (picked by file suffix, or folder for HF datasets)."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_datasets(register):
    register("parquet", "polyrl.data.loaders:load_parquet", suffixes=[".parquet"])
    register("jsonl", "polyrl.data.loaders:load_jsonl", suffixes=[".jsonl", ".json"])
    register("hf_disk", "polyrl.data.loaders:load_hf_dataset", suffixes=["/"])
