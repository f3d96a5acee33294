"""A user's model, batch and loss functions are checked in the calling process, before any rank starts: a
wrong signature, a batch of the wrong shape or a model that does not build is refused by its flag, where
inside the ranks it would be a TypeError in a worker's log."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from .catalog import Scenario
from .failure import user_frames
from .job import DTYPES


class ScenarioError(ValueError):
    """A factory the ranks could not use; the message names its flag and function."""


def check(scenario: Scenario, dtype: str, model: str | None = None, batch: str | None = None,
          loss: str | None = None) -> None:
    """Raise ScenarioError for the first of the user's functions (named by `model`, `batch`, `loss`) that
    the ranks could not call as documented."""
    if loss:
        _signature(scenario.loss_fn, f"--loss {loss}", ("output", "target"), "(output, target) -> loss")
    if not (model and batch):
        return
    _signature(scenario.make_model, f"--model {model}", (), "() -> torch.nn.Module")
    _signature(scenario.make_batch, f"--batch {batch}", ("step", "micro", "rank", "dtype"),
               "(step, micro, rank, dtype) -> (args, kwargs, target)")
    made = _call(scenario.make_batch, f"--batch {batch}", 1, 0, 0, DTYPES[dtype])
    if not (isinstance(made, (tuple, list)) and len(made) == 3 and isinstance(made[0], (tuple, list))
            and isinstance(made[1], dict) and torch.is_tensor(made[2])):
        raise ScenarioError(f"--batch {batch}: expected (args: tuple, kwargs: dict, target: Tensor), it returned "
                            f"{_shape(made)} for step 1, micro-batch 0, rank 0")
    built = _call(scenario.make_model, f"--model {model}")
    if not isinstance(built, nn.Module):
        raise ScenarioError(f"--model {model}: expected a torch.nn.Module, it returned {type(built).__name__}")


def _signature(fn: Callable | None, flag: str, names: tuple[str, ...], expected: str) -> None:
    try:
        inspect.signature(fn).bind(*names)
    except TypeError:
        raise ScenarioError(f"{flag}: expected a function {expected}, its signature is "
                            f"{inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        return


def _call(fn: Callable, flag: str, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        where = user_frames(exc)
        raise ScenarioError(f"{flag} raised {type(exc).__name__}: {exc}"
                            + (f" (at {where[-1]})" if where else "")) from exc


def _shape(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
