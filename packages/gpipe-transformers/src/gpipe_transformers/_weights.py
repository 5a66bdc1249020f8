"""A causal LM's weights, the safetensors files transformers reads and writes, each rank
reading and writing only its own tensors.

A saved model is a directory: the configuration (``config.json``) and the tensors under
the model's own names, in one safetensors file (``model.safetensors``) or in several with
an index (``model.safetensors.index.json``, whose ``weight_map`` says which file holds
each name).

The files may hold a tensor of the model under another name, or in pieces: transformers
saves a mixture of experts' fused parameters (``mlp.experts.gate_up_proj``) as one tensor
per expert (``mlp.experts.0.gate_proj.weight`` ...), and converts them back when it loads.
:class:`Conversions` maps the files' keys onto the model's tensors with transformers' own
conversions (``get_model_conversion_mapping``, ``rename_source_key`` and each
``WeightConverter``'s ``convert``), as its ``from_pretrained`` does, so that every layout it
loads is read.

Reading (:class:`WeightFiles`, :class:`Conversions`, :class:`Loader`): the pipeline's
``init`` for a model built on the meta device initialises each of this rank's layers: the
non-persistent buffers (RoPE's ``inv_freq``, an embedding scale) by the model's own weight
initialisation (``_init_weights``, as transformers does after building on meta), then every
other tensor read from the files, made of the keys it is converted from, read one at a time
(``safetensors.safe_open``): another rank's keys are never read. A tied tensor (the head
that shares the embedding) is read under any of its names: transformers writes the
embedding only.

Writing (:func:`save_weights`) is a collective over the pipeline's ranks: each writes one
file of its own tensors, in the layout transformers' ``save_pretrained`` writes (its
``revert_weight_conversion``: one tensor per expert), and the first also the configuration
and the index, after gathering every rank's names. A tied copy is written once, under the
name transformers keeps.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "CONFIG",
    "Conversions",
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

    def meta(self, key: str) -> Tensor:
        """A tensor of ``key``'s shape on the meta device, nothing read but the file's
        header: in the file's dtype when floating-point, else in float32 (a stand-in)."""
        part = self._handle(key).get_slice(key)
        dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32)
        return torch.empty(part.get_shape(), dtype=dtype, device="meta")

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


class _Recipe:
    """How some of the model's tensors (its ``targets``) are made: the ``transform`` of
    transformers that makes them (a ``WeightConverter``, or a ``WeightRenaming`` of one
    key) and the checkpoint ``keys`` it converts, each with the source pattern it
    matched."""

    def __init__(self, transform: Any, targets: list[str], converts: bool) -> None:
        self.transform = transform
        self.targets = targets
        self.converts = converts
        self.keys: list[tuple[str, str]] = []


class Conversions:
    """Which keys of the weight ``files`` each of ``model``'s tensors is made from, and how,
    as transformers' ``from_pretrained`` maps them.

    Every key is renamed by the model's conversions (transformers'
    ``get_model_conversion_mapping``: its family's renamings and converters, and the base
    model's prefix added or removed, by ``rename_source_key``); the keys that make one of
    the model's tensors are converted together by a copy of the transform that matched
    them (a ``WeightConverter``'s ``convert``: one tensor per expert stacked into the fused
    parameter), when it is read. Keys that make none of the model's tensors are not read,
    as transformers leaves them out. The mapping is of names only: every rank makes it,
    reading no tensor, and reads only the keys of the tensors it asks for (:meth:`read`).

    As transformers' ``from_pretrained`` does, the model keeps the conversions that
    matched (``_weight_conversions``), which saving reverts."""

    def __init__(self, model: nn.Module, files: WeightFiles) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.model = model
        self.files = files
        self.expected: dict[str, Tensor] = model.state_dict(keep_vars=True)
        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        #: Each recipe under the first name it makes, and the recipe of every name made.
        self.recipes: dict[str, _Recipe] = {}
        self.made: dict[str, str] = {}
        self._ready: dict[str, Tensor] = {}
        for key in sorted(files.files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, self.expected)
            if name not in self.expected and key in self.expected:
                # A key of the model's own that a renaming did not mean (as transformers).
                name, pattern = rename_source_key(key, [], [], prefix, self.expected)
            if name not in self.expected:
                continue
            recipe = self.recipes.get(name)
            if recipe is None:
                if pattern is None:
                    recipe = _Recipe(WeightRenaming(key, name), [name], converts=False)
                else:
                    # A converter makes a tensor of each target pattern (transformers names
                    # them so when it reports them unexpected).
                    transform = copy.deepcopy(by_pattern[pattern])
                    first = transform.target_patterns[0]
                    targets = [name.replace(first, t) for t in transform.target_patterns]
                    recipe = _Recipe(transform, targets, converts=True)
                self.recipes[name] = recipe
                for target in recipe.targets:
                    self.made.setdefault(target, name)
            recipe.keys.append((key, key if pattern is None else pattern))
        used = [transform for transform in transforms if transform.was_used()]
        setattr(model, "_weight_conversions", used)  # noqa: B010 (not a module's attribute)

    def source(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` (a tensor's names: its own, then its aliases) that the
        checkpoint's keys make, or None."""
        return next((name for name in names if name in self.made), None)

    def keys(self, name: str) -> list[str]:
        """The checkpoint's keys that make the model's tensor ``name``."""
        return [key for key, _ in self.recipes[self.made[name]].keys]

    def read(self, name: str) -> Tensor:
        """The model's tensor ``name`` (one :meth:`source` gave), read from its keys and
        converted as transformers converts them; the other tensors the same keys make are
        kept until they are read."""
        ready = self._ready.pop(name, None)
        if ready is not None:
            return ready
        made = self._convert(self.made[name], self.files.read)
        value = made.pop(name)
        self._ready.update(made)
        return value

    def check(self) -> None:
        """Refuse the checkpoint unless it makes every tensor of the model the files hold
        (not non-persistent buffers), of its shape: the conversions run on the meta
        device (the files' headers only), so every rank checks, before anything is read.

        Raises:
            KeyError: a tensor of the model that no key makes, or a key missing of those a
                conversion needs (in the checkpoint's names, as transformers writes them).
            ValueError: a conversion that makes a tensor of another shape than the model's.
        """
        names = aliases(self.model)
        missing = [n for n in persistent(self.model) if self.source(names.get(n, [n])) is None]
        if missing:
            written = [k for k in self.written(missing) if k not in missing]
            also = f", in the checkpoint's names: {_few(written)}" if written else ""
            raise KeyError(
                f"the checkpoint lacks tensors of the model {type(self.model).__name__}: save "
                f"it again, or check that the configuration is the weights' (missing: "
                f"{_few(missing)}{also}, file: {self.files.source})"
            )
        for first, recipe in self.recipes.items():
            if not recipe.converts:
                continue  # one key, whose shape is checked when it is read
            targets = recipe.targets
            failed: Exception | None = None
            try:
                made = self._convert(first, self.files.meta)
            except (RuntimeError, ValueError, IndexError, KeyError) as error:
                failed, made = error, {}  # keys that do not fit together (a stack, a cat)
            wrong = [n for n in targets if n not in made or made[n].shape != self.expected[n].shape]
            if not wrong:
                continue
            lacking = [k for k in self.written(targets) if k not in self.files.files]
            if lacking:
                raise KeyError(
                    f"the checkpoint lacks tensors of the model {type(self.model).__name__} "
                    f"that transformers converts into its {_few(targets)}: save it again, or "
                    f"check that the configuration is the weights' (missing: {_few(lacking)}, "
                    f"file: {self.files.source})"
                ) from failed
            raise ValueError(
                f"the checkpoint's keys {_few(self.keys(first))} do not make the model's "
                f"{_few(wrong)} of its shape: the configuration and the weights do not match "
                f"(model: {[tuple(self.expected[n].shape) for n in wrong]}, file: "
                f"{self.files.source})"
            ) from failed

    def written(self, names: Sequence[str]) -> list[str]:
        """The keys transformers' ``save_pretrained`` writes the model's tensors ``names``
        under (its ``revert_weight_conversion``, on the meta device)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {name: self.expected[name].to("meta") for name in names}
        try:
            return list(revert_weight_conversion(self.model, state))  # type: ignore[arg-type]
        except (RuntimeError, ValueError, IndexError, KeyError):  # not revertible: as named
            return list(names)

    def _convert(self, first: str, reader: Callable[[str], Tensor]) -> dict[str, Tensor]:
        """The tensors recipe ``first`` makes, of its keys read by ``reader`` (in the
        model's dtype, as transformers reads them, before converting), by their names."""
        recipe = self.recipes[first]
        transform = copy.deepcopy(recipe.transform)
        dtype = self.expected[first].dtype

        def reading(key: str) -> Callable[[], Tensor]:
            return lambda: reader(key).to(dtype)

        for key, pattern in recipe.keys:
            transform.add_tensor(first, key, pattern, reading(key))
        made = transform.convert(first, model=self.model, config=self.model.config)
        return {n: v[0] if isinstance(v, list) else v for n, v in made.items()}


def _few(names: Sequence[str], count: int = 8) -> str:
    """The first ``count`` of ``names``, as an error shows them."""
    return f"{list(names[:count])}{' ...' if len(names) > count else ''}"


class Loader:
    """``init`` for the pipeline: sets each tensor of a layer made from the meta device,
    the non-persistent buffers by the model's own initialisation and the others read
    from the weight files, through their ``conversions`` (:class:`Conversions`)."""

    def __init__(self, model: nn.Module, conversions: Conversions) -> None:
        self.model = model
        self.conversions = conversions
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
        files = self.conversions.files
        made = self.conversions.source(self.aliases.get(name, [name]))
        if made is None:  # checked for every name before the pipeline was built
            raise KeyError(f"{name} is not in the checkpoint {files.source}")
        value = self.conversions.read(made)
        if value.shape != tensor.shape:
            keys = self.conversions.keys(made)
            raise ValueError(
                f"the checkpoint's {keys[0] if len(keys) == 1 else _few(keys)} has another "
                f"shape than the model's {name}: the configuration and the weights do not "
                f"match (checkpoint: {tuple(value.shape)}, model: {tuple(tensor.shape)}, "
                f"file: {files.files[keys[0]]})"
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
    writes (the pipeline's state dict, less what it does not hold), each sharded one
    (a DTensor, on a mesh) gathered whole: a collective of the ranks that shard it."""
    module = sys.modules.get("torch.distributed.tensor")
    sharded = getattr(module, "DTensor", ())
    return {
        key: value.full_tensor() if isinstance(value, sharded) else value
        for key, value in pipe.state_dict().items()
        if not value.is_meta
    }


def _everyone(value: Any, group: dist.ProcessGroup | None, count: int) -> list[Any]:
    """Every rank's ``value`` of ``group``'s (``[value]`` in one process)."""
    if group is None:
        return [value]
    found: list[Any] = [None] * count
    dist.all_gather_object(found, value, group=group)
    return found


def save_weights(
    pipe: nn.Module,
    model: Any,
    path: str | os.PathLike[str],
    group: dist.ProcessGroup | None,
    data_groups: Sequence[dist.ProcessGroup] = (),
) -> None:
    """Write the causal LM ``model`` to the directory ``path`` as transformers does, with
    the tensors this rank holds of ``pipe`` (its state dict, under the model's names,
    sharded tensors gathered whole), in the layout transformers' ``save_pretrained``
    writes (its ``revert_weight_conversion``: a fused mixture of experts as one tensor per
    expert): a collective over ``group``'s ranks and the ``data_groups``' (its
    ``data_group``, or its mesh's data-parallel dimensions), of whose ranks the first
    write (see :func:`gpipe_transformers.save_pretrained`)."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    mine = _local_state(pipe)
    if any(dist.get_rank(data_group) != 0 for data_group in data_groups):
        return
    rank = dist.get_rank(group) if group is not None else 0
    count = dist.get_world_size(group) if group is not None else 1
    folder = Path(path)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for old in (SINGLE, INDEX, *(p.name for p in folder.glob("model-*-of-*.safetensors"))):
            (folder / old).unlink(missing_ok=True)
    owner: dict[str, int] = {}
    for holder, found in enumerate(_everyone(list(mine), group, count)):
        for key in found:
            owner.setdefault(key, holder)
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target, source in tied.items():
        if target in owner and source in owner:
            del owner[target]
    kept = {
        key: value.detach().to("cpu").contiguous().clone()
        for key, value in mine.items()
        if owner.get(key) == rank
    }
    # Each rank holds whole layers, so that it reverts the conversions of its own tensors.
    written = {
        key: value.contiguous() for key, value in revert_weight_conversion(model, kept).items()
    }
    sizes = {key: value.numel() * value.element_size() for key, value in written.items()}
    everyone: list[dict[str, int]] = _everyone(sizes, group, count)
    name = SINGLE if count == 1 else shard_name(rank, count)
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
            weight_map = {
                key: shard_name(holder, count)
                for holder, found in enumerate(everyone)
                for key in sorted(found)
            }
            total = sum(size for found in everyone for size in found.values())
            index: dict[str, object] = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _everyone(None, group, count)  # every file written on return
