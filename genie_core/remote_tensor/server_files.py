"""Weights loaded where they lie: a checkpoint on the server's disk becomes remote tensors without
a byte of it crossing the network (`torch.remote_accelerator.load`, `from_pretrained`). The server
reads the file onto its device (genie_core/worker/checkpoints.py) in one round trip that answers
with the checkpoint's structure; the tensors stay there."""

from __future__ import annotations

import json
import posixpath
import warnings
from typing import Any

from .connection import _index, stream_for
from .stream import new_ids


def load(path: str, device: Any = None) -> Any:
    """`torch.load(path, map_location=device, weights_only=True)` of a file on the server (or a
    safetensors file, or a transformers model directory: its state dict, shards merged), its tensors
    on `device` (default: the current `remote_accelerator`). A relative path is the server's, as a
    `%%remote` cell of the session sees it."""
    from torch.utils._pytree import tree_unflatten, treespec_loads

    from .tensor import described_tensor

    stream = stream_for(_index(device) if device is not None else None)
    first = new_ids().start
    answer = stream.answer(("load", first, str(path)))["value"]
    leaves = [described_tensor(d, stream) if "id" in d else d["value"] for d in answer["leaves"]]
    return tree_unflatten(leaves, treespec_loads(answer["spec"]))


def read_text(path: str, device: Any = None) -> str:
    """A small text file on the server (a model's config.json)."""
    return str(stream_for(_index(device) if device is not None else None).answer(("read", str(path)))["value"])


def from_pretrained(model_class: Any, path: str, *, device: Any = None, **config_changes: Any) -> Any:
    """A transformers model from a directory on the server (what `save_pretrained` wrote there, or a
    model cache's snapshot folder): its config read from there, the model built on the device, and
    its weights loaded there and put in place (`load_state_dict(..., assign=True)`). `model_class`:
    a model class or an Auto class (`AutoModelForCausalLM`); `config_changes` update the config.
    Returns the model in eval mode, as transformers' `from_pretrained` does."""
    import torch
    import transformers

    target = torch.device(device if device is not None else "remote_accelerator")
    values = json.loads(read_text(posixpath.join(str(path), "config.json"), target))
    config_class = getattr(model_class, "config_class", None)
    if config_class is not None:
        config = config_class.from_dict(values)
    else:
        config = transformers.AutoConfig.for_model(**values)
    for name, value in config_changes.items():
        setattr(config, name, value)
    with torch.device(target):  # built on the device: parameters and buffers made there, no bytes sent
        model = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    state = load(str(path), target)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    named = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(named[k]) for k in state if k in named}
    missing = [k for k in missing if id(named.get(k)) not in loaded]  # (a tied weight is its source's)
    if missing or unexpected:
        warnings.warn(
            f"{path}: weights not in the checkpoint (left as initialized): {missing or 'none'}; "
            f"in the checkpoint but not in the model (ignored): {unexpected or 'none'}",
            stacklevel=2,
        )
    return model.eval()
