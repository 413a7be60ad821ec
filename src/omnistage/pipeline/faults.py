"""Fault isolation: what fails while a stage works on one request fails that request only.

A stage runs its per-request host work (admitting a request, handling its step output) through
`StepFaults.run`, which records a failure instead of raising; its worker then fails those requests.
An exception out of a whole step (a batched forward) fails the step's requests (`stage.step_requests`).
Only errors that leave the device unusable, or a stage that keeps failing with nothing to blame, end
the stage (the engine then reports unhealthy and refuses new requests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from omnistage.engine.request import Request

T = TypeVar("T")

# NOTE: a device error (illegal address, device-side assert, lost device) poisons the context: every
# later kernel fails too, so it is fatal rather than one request's fault. Out-of-memory is not.
FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError,)
MAX_UNBLAMED_FAILURES = 3  # consecutive failed steps with no request to blame before the stage is dead


class StepFaults:
    """Per-request failures recorded during one step of a stage, drained by its worker."""

    def __init__(self) -> None:
        self.failed: list[tuple[Request, Exception]] = []

    def run(self, req: Request, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`; on an exception (not a fatal one) record it against `req` and return None."""
        try:
            return fn(*args)
        except FATAL_ERRORS:
            raise
        except Exception as e:
            self.failed.append((req, e))
            return None

    def drain(self) -> list[tuple[Request, Exception]]:
        out, self.failed = self.failed, []
        return out


def together(fn: Callable[..., T], *args: Any) -> T | None:
    """`fn(*args)` for several requests at once; None when it fails, blaming none of them: the caller then
    handles each request alone, so that only the one at fault fails."""
    try:
        return fn(*args)
    except FATAL_ERRORS:
        raise
    except Exception:
        return None


def is_fatal(error: BaseException) -> bool:
    return isinstance(error, FATAL_ERRORS) or not isinstance(error, Exception)


class EngineDeadError(RuntimeError):
    """A stage has died: the engine refuses new requests (the server answers 503, /health is unhealthy)."""


class NoReplicaError(EngineDeadError):
    """Every replica of a stage is down, being started again: new requests are refused meanwhile (503)."""


class EngineOverloaded(RuntimeError):
    """Admission is full (waiting requests or waiting prompt tokens): try again after `retry_after` s."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
