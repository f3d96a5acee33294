"""Trace logic: cross-module read registration, persistent-parameter state, validation and recovery."""
from .guard import TraceGuard
from .registration import on_read

__all__ = ["TraceGuard", "on_read"]
