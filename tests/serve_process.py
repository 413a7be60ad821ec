"""A real `omnistage serve` process on the built-in tiny checkpoint (CPU deploy config), and what the server
tests share (fixtures: serve_fixtures.py)."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from omnistage.config import DEPLOY_DIR

MODEL = "qwen3-omni-tiny-random"
KEY = "sk-test"
USER = [{"role": "user", "content": "Say hello to Paris."}]


def samples(frames: int) -> int:
    return frames * 1920 - 555


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, log: Path, *args: str) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "omnistage.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--device", "cpu",
               "--deploy-config", str(DEPLOY_DIR / "qwen3_omni_moe.yaml"), *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wav_samples(data: bytes) -> np.ndarray:
    info = sf.info(io.BytesIO(data))
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
    return sf.read(io.BytesIO(data), dtype="int16")[0]
