"""Config schemas and loading (OmegaConf structured configs, YAML plus key=value overrides)."""
