"""The exceptions polyrl raises for bad input. Each message says what, where and what to do."""

from __future__ import annotations


class PolyrlError(Exception):
    """Base of every polyrl error a user can cause and fix."""


class ManifestError(PolyrlError):
    """A manifest that cannot be read, has unknown keys, or asks for plugins that are not installed."""


class PluginLoadError(PolyrlError):
    """A plugin that fails to import, or implements a hook that does not exist."""


class RegistryError(PolyrlError, LookupError):
    """A duplicate registration, an unknown name, or an import string that does not resolve."""


class ConfigError(PolyrlError, ValueError):
    """A config key that does not exist or a value of the wrong type; names the key and the file."""


class DataError(PolyrlError, ValueError):
    """A dataset file or row polyrl cannot use; names the file and the row."""


class ModelFetchError(PolyrlError):
    """A model that could not be downloaded, or whose files do not hash to what they must."""

    #: True when the download itself failed (no route to the package index), not the files.
    network: bool = False


class CheckpointError(PolyrlError, ValueError):
    """A checkpoint that is missing, partial, or from another model or world size."""


class CheckpointDiskFullError(CheckpointError):
    """The file system filled up while a checkpoint was written; the previous checkpoint is left whole."""

    #: What the operating system said, and the file (``"No space left on device, /ckpt/__0_0.distcp"``).
    reason: str = ""


class RewardError(PolyrlError, RuntimeError):
    """A run whose rewards failed for every sample ``reward.max_failed_steps`` steps in a row."""
