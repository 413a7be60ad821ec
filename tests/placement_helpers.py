"""Shared by the placement tests: an engine of a remote placement and its local twin on the same deploy config."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from omnistage.config import DeployConfig
from omnistage.entrypoints.omni import Omni


@contextlib.contextmanager
def twins(d: Path, deploy: DeployConfig, placement: str, device: str = "cpu") -> Iterator[tuple[Omni, Omni]]:
    """(the engine with `placement`, the local one), both shut down afterwards."""
    remote = local = None
    try:
        remote = Omni(d, deploy=deploy, device=device, placement=placement)
        local = Omni(d, deploy=deploy, device=device)
        yield remote, local
    finally:
        for o in (remote, local):
            if o is not None:
                o.engine.shutdown()
