"""A causal LM's weights, the safetensors files transformers reads and writes, each rank
reading and writing only its own tensors.

A saved model is a directory: the configuration (``config.json``) and the tensors under
the model's own names, in one safetensors file (``model.safetensors``) or in several with
an index (``model.safetensors.index.json``, whose ``weight_map`` says which file holds
each name).

Reading (:class:`WeightFiles`, :class:`Loader`): the pipeline's ``init`` for a model built
on the meta device initialises each of this rank's layers: the non-persistent buffers
(RoPE's ``inv_freq``, an embedding scale) by the model's own weight initialisation
(``_init_weights``, as transformers does after building on meta), then every other tensor
read from the files, one key at a time (``safetensors.safe_open``). A tied tensor (the head
that shares the embedding) is read under any of its names: transformers writes the
embedding only.

Writing (:func:`save_weights`) is a collective over the pipeline's ranks: each writes one
file of its own tensors, and the first also the configuration and the index, after
gathering every rank's names. A tied copy is written once, under the name transformers
keeps.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "CONFIG",
    "Loader",
    "WeightFiles",
    "aliases",
    "persistent",
    "save_weights",
    "saved_dtype",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


# The floating-point dtypes of safetensors' headers.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def shard_name(rank: int, count: int) -> str:
    """The file of rank ``rank``'s tensors, of ``count`` ranks."""
    return f"model-{rank + 1:05d}-of-{count:05d}.safetensors"


class WeightFiles:
    """The safetensors files of a saved model's directory: which file holds each key, each
    file opened when a key of it is first read."""

    def __init__(self, folder: Path) -> None:
        index, single = folder / INDEX, folder / SINGLE
        self.files: dict[str, Path] = {}
        if index.is_file():
            self.source = index
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"the checkpoint index has no weight_map (file: {index})")
            self.files = {str(key): folder / str(name) for key, name in weight_map.items()}
            absent = sorted({str(f) for f in self.files.values() if not f.is_file()})
            if absent:
                raise FileNotFoundError(
                    f"the checkpoint files that {INDEX} names are missing: copy them into the "
                    f"directory, or save the model again (missing: {absent}, index: {index})"
                )
        elif single.is_file():
            from safetensors import safe_open

            self.source = single
            with safe_open(str(single), framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), single)
        else:
            raise FileNotFoundError(
                f"the directory holds no safetensors checkpoint: from_pretrained reads "
                f"{SINGLE}, or the shards its index {INDEX} names (as save_pretrained writes "
                f"them; PyTorch .bin checkpoints are not read) (path: {folder})"
            )
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def dtype(self) -> torch.dtype | None:
        """The dtype of the files' first floating-point tensor, as transformers'
        ``dtype="auto"`` reads it when the configuration has none (None: no such tensor)."""
        for key in self.files:
            found = _SAFETENSORS_DTYPES.get(self._handle(key).get_slice(key).get_dtype())
            if found is not None:
                return found
        return None

    def find(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` the files hold."""
        return next((name for name in names if name in self.files), None)

    def read(self, key: str) -> Tensor:
        """The tensor ``key`` (on the CPU, in the file's dtype)."""
        tensor: Tensor = self._handle(key).get_tensor(key)
        return tensor

    def _handle(self, key: str) -> Any:
        """The open file that holds ``key``."""
        from safetensors import safe_open

        file = self.files[key]
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = self._stack.enter_context(
                safe_open(str(file), framework="pt", device="cpu")
            )
        return handle

    def close(self) -> None:
        """Close the files opened."""
        self._stack.close()
        self._open.clear()


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """The names the weights may hold each of ``model``'s parameters and buffers under:
    its own first, then those of the same tensor elsewhere (a tied head and embedding),
    then each without the base model's prefix (``transformer.h.0...`` as ``h.0...``, as
    the weights of the base model alone have them)."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        by_tensor.setdefault(id(tensor), []).append(name)
    found: dict[str, list[str]] = {}
    for names in by_tensor.values():
        for name in names:
            own = [name, *(other for other in names if other != name)]
            bare = [n[len(prefix) :] for n in own if prefix != "." and n.startswith(prefix)]
            found[name] = own + bare
    return found


def persistent(model: nn.Module) -> list[str]:
    """The names of ``model``'s tensors the weights hold (not non-persistent buffers)."""
    return list(model.state_dict(keep_vars=True))


class Loader:
    """``init`` for the pipeline: sets each tensor of a layer made from the meta device,
    the non-persistent buffers by the model's own initialisation and the others read
    from the weight ``files``."""

    def __init__(self, model: nn.Module, files: WeightFiles) -> None:
        self.model = model
        self.files = files
        self.aliases = aliases(model)
        self.module_names: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.module_names.setdefault(id(module), []).append(name)

    def __call__(self, piece: nn.Module) -> None:
        initialise = getattr(self.model, "_init_weights", None)
        for module in piece.modules():
            names = self.module_names.get(id(module))
            if names is None:
                continue  # a piece itself, not a module of the model
            if module._non_persistent_buffers_set and callable(initialise):
                initialise(module)
            prefix = f"{names[0]}." if names[0] else ""
            for slot, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is None or tensor.is_meta:
                    continue
                if slot in module._non_persistent_buffers_set:
                    continue
                self._load(prefix + slot, tensor)

    def _load(self, name: str, tensor: Tensor) -> None:
        key = self.files.find(self.aliases.get(name, [name]))
        if key is None:  # checked for every name before the pipeline was built
            raise KeyError(f"{name} is not in the checkpoint {self.files.source}")
        value = self.files.read(key)
        if value.shape != tensor.shape:
            raise ValueError(
                f"the checkpoint's {key} has another shape than the model's {name}: the "
                f"configuration and the weights do not match (checkpoint: "
                f"{tuple(value.shape)}, model: {tuple(tensor.shape)}, file: "
                f"{self.files.files[key]})"
            )
        tensor.copy_(value)


def saved_dtype(config: Any, files: WeightFiles) -> torch.dtype:
    """The dtype ``"auto"`` builds in: the configuration's, else the weights' first
    floating-point tensor's, else the default dtype (as transformers does)."""
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if isinstance(saved, torch.dtype):
        return saved
    return files.dtype() or torch.get_default_dtype()


def _local_state(pipe: nn.Module) -> dict[str, Tensor]:
    """This rank's tensors, under the model's names (``model.layers.0...``): what it
    writes (the pipeline's state dict, less what it does not hold)."""
    return {key: value for key, value in pipe.state_dict().items() if not value.is_meta}


def save_weights(
    pipe: nn.Module,
    model: Any,
    path: str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    data_group: dist.ProcessGroup | None,
) -> None:
    """Write the causal LM ``model`` to the directory ``path`` as transformers does, with
    the tensors this rank holds of ``pipe`` (its state dict, under the model's names): a
    collective over ``group``'s ranks; of ``data_group``'s replicas, the first writes (see
    :func:`gpipe_transformers.save_pretrained`)."""
    from safetensors.torch import save_file

    if data_group is not None and dist.get_rank(data_group) != 0:
        return
    rank = dist.get_rank(group) if group is not None else 0
    count = dist.get_world_size(group) if group is not None else 1
    folder = Path(path)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for old in (SINGLE, INDEX, *(p.name for p in folder.glob("model-*-of-*.safetensors"))):
            (folder / old).unlink(missing_ok=True)
    mine = _local_state(pipe)
    sizes = {key: value.numel() * value.element_size() for key, value in mine.items()}
    everyone: list[dict[str, int]] = [sizes]
    if group is not None:
        everyone = [{} for _ in range(count)]
        dist.all_gather_object(everyone, sizes, group=group)
    owner: dict[str, int] = {}
    for holder, found in enumerate(everyone):
        for key in found:
            owner.setdefault(key, holder)
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target, source in tied.items():
        if target in owner and source in owner:
            del owner[target]
    name = SINGLE if count == 1 else shard_name(rank, count)
    written = {
        key: value.detach().to("cpu").contiguous().clone()
        for key, value in mine.items()
        if owner.get(key) == rank
    }
    if written or count == 1:
        save_file(written, str(folder / name), metadata={"format": "pt"})
    if rank == 0:
        config = model.config
        config.architectures = [type(model).__name__]
        # The model's dtype now (it may have been converted since it was built), written
        # as transformers' save_pretrained writes it: "bfloat16".
        config.dtype = str(model.dtype).removeprefix("torch.")
        config.save_pretrained(str(folder))
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            generation.save_pretrained(str(folder))
        if count > 1:
            weight_map = {k: shard_name(r, count) for k, r in sorted(owner.items())}
            total = sum(everyone[r][k] for k, r in owner.items())
            index: dict[str, object] = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if group is not None:
        done: list[None] = [None] * count
        dist.all_gather_object(done, None, group=group)  # every file written on return
