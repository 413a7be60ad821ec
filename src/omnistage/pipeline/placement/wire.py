"""What crosses a pipe between the serving process and a replica's worker process: pickle, with tensors as
their bytes in the pickle stream (any dtype, bfloat16 and float8 included). Torch's own reductions would put
each tensor in a new shared-memory file: a file, an mmap and a file descriptor sent per tensor, dearer than
copying a payload's few KB (one token's hidden rows) or MB (a prompt's rows) through the pipe."""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch


def _tensor(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            return _tensor, (t.reshape(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


loads = pickle.loads
