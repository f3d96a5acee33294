"""Checkpoints that are written atomically, verified on load, and carry what exact resume needs."""
from .errors import CheckpointError
from .manifest import MANIFEST, Manifest, verify

__all__ = ["CheckpointError", "MANIFEST", "Manifest", "verify"]
