"""Every error a user can cause and fix. Each message names the problem, where it is (the file, field,
column, row, URI or folder) and the fix; `alignflow` prints it as one line, without a traceback
(`trainer.cli.main.explain_error`). Anything else is a bug and keeps its traceback.

A leaf: it imports nothing from alignflow, so every layer can raise these.
"""

from __future__ import annotations


class AlignflowError(Exception):
    """The base of the errors below: `except AlignflowError` catches every one a user can fix."""


class ConfigError(AlignflowError, ValueError):
    """A config value is wrong; the message says which field and how to fix it."""


class DataError(AlignflowError, ValueError):
    """The data cannot be used; the message names the dataset, column or row and the fix."""


class StorageError(AlignflowError, OSError):
    """A storage location cannot be used; the message names it and what to check."""


class DiskFullError(StorageError):
    """A checkpoint did not fit on the disk it was written to; the message names the folder and the space needed."""


class NonFiniteWeightsError(AlignflowError, ValueError):
    """A model holds NaN or infinite weights; no checkpoint of it is ever marked complete."""


class CheckpointError(AlignflowError, ValueError):
    """A checkpoint cannot be resumed: corrupt, incomplete, or from a different run; the message says what to do."""


class UnsafeCheckpointError(AlignflowError, ValueError):
    """A checkpoint file holds pickled Python objects that loading would have to execute."""


class TrainingError(AlignflowError, RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says what to change."""


class ModelError(AlignflowError, ValueError):
    """The model cannot be loaded; the message says why and what to pass instead."""


class RegistryError(AlignflowError, RuntimeError):
    """Promotion cannot go ahead; the message names the URI, model or metric and the fix."""


class RewardError(AlignflowError, ValueError):
    """A reward function misbehaved; the message names it and the first bad sample."""


class MissingExtra(AlignflowError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


class RolloutServerError(AlignflowError, RuntimeError):
    """The rollout server cannot be reached, refused a request, or stopped: the message says what to do."""
