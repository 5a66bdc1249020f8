"""A causal LM's checkpoint, each rank reading and writing only its own tensors:
:func:`from_pretrained` and :func:`save_pretrained`.

A Hugging Face checkpoint is a directory: the configuration (``config.json``) and the
tensors under the model's own names, in one safetensors file (``model.safetensors``) or in
several with an index (``model.safetensors.index.json``, whose ``weight_map`` says which
file holds each name).

:func:`from_pretrained` builds the model from the configuration on the meta device (no
memory), lets the pipeline make this rank's layers (gpipe-core's ``init``: another rank's
stay on meta), and initialises each of them here: the non-persistent buffers (RoPE's
``inv_freq``, an embedding scale) by the model's own weight initialisation
(``_init_weights``, as transformers does after building on meta), then every other tensor
read from the checkpoint, one key at a time (``safetensors.safe_open``). A tied tensor (the
head that shares the embedding) is read under any of its names: transformers writes the
embedding only.

:func:`save_pretrained` is a collective over the pipeline's ranks: each writes one file of
its own tensors, and the first also the configuration and the index, after gathering every
rank's names. A tied copy is written once, under the name transformers keeps.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe_core import CheckpointMode

from ._pipeline import pipeline

if TYPE_CHECKING:
    from ._pipeline import CausalLMPipe

__all__ = ["from_pretrained", "save_pretrained"]

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


def _shard_name(rank: int, count: int) -> str:
    return f"model-{rank + 1:05d}-of-{count:05d}.safetensors"


class _Checkpoint:
    """The safetensors files of a checkpoint directory: which file holds each key, each
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
        """The dtype of the checkpoint's first floating-point tensor, as transformers'
        ``dtype="auto"`` reads it when the configuration has none (None: no such tensor)."""
        for key in self.files:
            found = _SAFETENSORS_DTYPES.get(self._handle(key).get_slice(key).get_dtype())
            if found is not None:
                return found
        return None

    def find(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` the checkpoint holds."""
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
        self._stack.close()
        self._open.clear()


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """The names a checkpoint may hold each of ``model``'s parameters and buffers under:
    its own first, then those of the same tensor elsewhere (a tied head and embedding),
    then each without the base model's prefix (``transformer.h.0...`` as ``h.0...``, as
    checkpoints of the base model alone have them)."""
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


def _persistent(model: nn.Module) -> list[str]:
    """The names of ``model``'s tensors a checkpoint holds (not non-persistent buffers)."""
    return list(model.state_dict(keep_vars=True))


class _Loader:
    """``init`` for the pipeline: sets each tensor of a layer made from the meta device,
    the non-persistent buffers by the model's own initialisation and the others from the
    checkpoint."""

    def __init__(self, model: nn.Module, checkpoint: _Checkpoint) -> None:
        self.model = model
        self.checkpoint = checkpoint
        self.aliases = _aliases(model)
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
        key = self.checkpoint.find(self.aliases.get(name, [name]))
        if key is None:  # checked for every name before the pipeline was built
            raise KeyError(f"{name} is not in the checkpoint {self.checkpoint.source}")
        value = self.checkpoint.read(key)
        if value.shape != tensor.shape:
            raise ValueError(
                f"the checkpoint's {key} has another shape than the model's {name}: the "
                f"configuration and the weights do not match (checkpoint: "
                f"{tuple(value.shape)}, model: {tuple(tensor.shape)}, file: "
                f"{self.checkpoint.files[key]})"
            )
        tensor.copy_(value)


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    checkpoint: CheckpointMode = "except_last",
    devices: Sequence[Any] | None = None,
    group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    placement: str | Sequence[int] | None = None,
    timeout: float | datetime.timedelta | object | None = ...,
    dtype: torch.dtype | str | None = "auto",
    attn_implementation: str | None = None,
) -> CausalLMPipe:
    """A pipeline of the causal LM saved in the directory ``path``, each rank building and
    reading only its own layers.

    The model is built from the directory's configuration on the meta device; the
    pipeline makes this rank's layers (and a tied copy its head shares with the
    embedding), initialises their non-persistent buffers (rotary position embeddings'
    ``inv_freq``) as the model's own weight initialisation does, and reads their tensors
    from the checkpoint (``model.safetensors``, or the shards of
    ``model.safetensors.index.json``), one key at a time: the other ranks' layers are never
    read nor allocated. Local files only: nothing is downloaded.

    Args:
        path: a directory written by ``model.save_pretrained(path)`` or
            :meth:`CausalLMPipe.save_pretrained`.
        balance, chunks, checkpoint, devices, group, data_group, placement, timeout: as
            :func:`pipeline`'s.
        dtype: the model's dtype, as ``AutoModelForCausalLM.from_pretrained``'s:
            ``"auto"`` (the default; None is the same) builds it in the configuration's
            ``dtype`` (which :func:`save_pretrained` writes), or without one in the
            dtype of the checkpoint's first floating-point tensor; a ``torch.dtype``
            (or its name, ``"bfloat16"``) builds it in that one. The checkpoint's tensors
            are converted to it.
        attn_implementation: ``"eager"``, ``"sdpa"`` ... (default: the model's).

    Returns:
        The pipeline; its :attr:`~CausalLMPipe.causal_lm` is the model, whose other ranks'
        tensors stay on the meta device.

    Raises:
        FileNotFoundError: ``path`` holds no configuration, no safetensors checkpoint, or
            its index names a file that is missing (the message names it).
        KeyError: the checkpoint lacks a tensor of the model (the message names the key
            and the file); a tied copy it does not hold is read from its other name.
        ValueError, LayoutError: as :func:`pipeline`; a tensor of another shape; a
            ``dtype`` that is none of those.

    Example:
        >>> import tempfile, torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(
        ...     vocab_size=64,
        ...     hidden_size=16,
        ...     intermediate_size=32,
        ...     num_hidden_layers=2,
        ...     num_attention_heads=2,
        ... )
        >>> model = LlamaForCausalLM(config)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     model.save_pretrained(folder)
        ...     pipe = from_pretrained(folder, balance=[1, 1], chunks=2)
        >>> ids = torch.randint(64, (4, 8))
        >>> losses = pipe.step(input_ids=ids, labels=ids)
        >>> torch.allclose(losses.reduced(), model(input_ids=ids, labels=ids).loss)
        True
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(
            f"the directory holds no model configuration ({CONFIG}): give a directory "
            f"written by save_pretrained (path: {folder})"
        )
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    chosen = _chosen_dtype(dtype)
    files = _Checkpoint(folder)
    try:
        options: dict[str, Any] = {"dtype": chosen or _saved_dtype(config, files)}
        if attn_implementation is not None:
            options["attn_implementation"] = attn_implementation
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **options)  # type: ignore[no-untyped-call]
        model.train()
        aliases = _aliases(model)
        missing = [n for n in _persistent(model) if files.find(aliases.get(n, [n])) is None]
        if missing:
            raise KeyError(
                f"the checkpoint lacks tensors of the model {type(model).__name__}: save it "
                f"again, or check that the configuration is the weights' (missing: "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, file: {files.source})"
            )
        return pipeline(
            model, balance=balance, chunks=chunks, checkpoint=checkpoint, devices=devices,
            group=group, data_group=data_group, placement=placement, timeout=timeout,
            init=_Loader(model, files),
        )  # fmt: skip
    finally:
        files.close()


def _chosen_dtype(dtype: object) -> torch.dtype | None:
    """The ``dtype`` given to :func:`from_pretrained` (None: ``"auto"``), or its refusal."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if isinstance(found, torch.dtype):
        return found
    raise ValueError(
        "dtype must be 'auto', a torch.dtype or the name of one, such as 'bfloat16', as "
        f"transformers' from_pretrained takes it (dtype: {dtype!r})"
    )


def _saved_dtype(config: Any, files: _Checkpoint) -> torch.dtype:
    """The dtype ``"auto"`` builds in: the configuration's, else the checkpoint's first
    floating-point tensor's, else the default dtype (as transformers does)."""
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if isinstance(saved, torch.dtype):
        return saved
    return files.dtype() or torch.get_default_dtype()


def local_state(pipe: CausalLMPipe) -> dict[str, Tensor]:
    """This rank's tensors, under the model's names (``model.layers.0...``): what it
    writes (the pipeline's state dict, less what it does not hold)."""
    return {key: value for key, value in pipe.state_dict().items() if not value.is_meta}


def save_pretrained(pipe: CausalLMPipe, path: str | os.PathLike[str]) -> None:
    """Write ``pipe``'s model to the directory ``path`` as transformers does: the
    configuration and the tensors under the model's names, which
    ``AutoModelForCausalLM.from_pretrained(path)`` and :func:`from_pretrained` load.

    In one process it writes ``config.json`` (with the model's dtype now, as transformers
    writes it, so that a model converted after it was built is read back in its dtype)
    and ``model.safetensors``. Across the ranks
    of the pipeline's ``group``, every rank must call it (a collective): each writes
    ``model-0000<rank+1>-of-0000<ranks>.safetensors`` holding its own tensors (on a file
    system every rank sees), and the first rank the configuration and
    ``model.safetensors.index.json``. With ``data_group``, the first replica writes; the
    others return. A tied copy is written once, as transformers does (the embedding, not
    ``lm_head.weight``); non-persistent buffers are not written; earlier checkpoint files
    in ``path`` are removed.

    Example:
        >>> import tempfile, torch
        >>> from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        >>> from gpipe_transformers import pipeline
        >>> config = LlamaConfig(
        ...     vocab_size=64,
        ...     hidden_size=16,
        ...     intermediate_size=32,
        ...     num_hidden_layers=2,
        ...     num_attention_heads=2,
        ... )
        >>> pipe = pipeline(LlamaForCausalLM(config), balance=[1, 1])
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     pipe.save_pretrained(folder)
        ...     loaded = AutoModelForCausalLM.from_pretrained(folder)
        >>> torch.equal(loaded.lm_head.weight, pipe.get_parameter("lm_head.weight"))
        True
    """
    from safetensors.torch import save_file

    group, data_group = pipe.__dict__["_groups"]
    if data_group is not None and dist.get_rank(data_group) != 0:
        return
    rank = dist.get_rank(group) if group is not None else 0
    count = dist.get_world_size(group) if group is not None else 1
    model: Any = pipe.causal_lm
    folder = Path(path)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for old in (SINGLE, INDEX, *(p.name for p in folder.glob("model-*-of-*.safetensors"))):
            (folder / old).unlink(missing_ok=True)
    mine = local_state(pipe)
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
    name = SINGLE if count == 1 else _shard_name(rank, count)
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
            weight_map = {k: _shard_name(r, count) for k, r in sorted(owner.items())}
            total = sum(everyone[r][k] for k, r in owner.items())
            index: dict[str, object] = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if group is not None:
        done: list[None] = [None] * count
        dist.all_gather_object(done, None, group=group)  # every file written on return
