"""A causal LM saved by transformers, as a pipeline and back: :func:`from_pretrained` and
:func:`save_pretrained`, each rank reading and writing only its own tensors.

:func:`from_pretrained` builds the model from the configuration on the meta device (no
memory), lets the pipeline make this rank's layers (gpipe-core's ``init``: another rank's
stay on meta), and initialises each of them from the model's weights (:mod:`._weights`).
:func:`save_pretrained` writes them (:meth:`CausalLMPipe.save_pretrained
<gpipe_transformers.CausalLMPipe.save_pretrained>`, a collective over the pipeline's ranks).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gpipe_core import CheckpointMode

from ._pipeline import CausalLMPipe, pipeline
from ._weights import CONFIG, Conversions, Loader, WeightFiles, saved_dtype

__all__ = ["from_pretrained", "save_pretrained"]


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
    experts_implementation: str | None = None,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
) -> CausalLMPipe:
    """A pipeline of the causal LM saved in the directory ``path``, each rank building and
    reading only its own layers.

    The model is built from the directory's configuration on the meta device; the
    pipeline makes this rank's layers (and a tied copy its head shares with the
    embedding), initialises their non-persistent buffers (rotary position embeddings'
    ``inv_freq``) as the model's own weight initialisation does, and reads their tensors
    from the weights (``model.safetensors``, or the shards of
    ``model.safetensors.index.json``), one key at a time: the other ranks' layers are never
    read nor allocated. Local files only: nothing is downloaded.

    The weights are read in any layout ``AutoModelForCausalLM.from_pretrained`` reads,
    through transformers' own conversions: a mixture of experts saved as one tensor per
    expert (``mlp.experts.0.gate_proj.weight``, as transformers saves it) is stacked into
    the model's fused parameters (``mlp.experts.gate_up_proj``), renamed keys are renamed,
    each rank reading only the keys its own tensors are made from.

    Args:
        path: a directory written by ``model.save_pretrained(path)`` or
            :meth:`CausalLMPipe.save_pretrained`.
        balance, chunks, checkpoint, devices, group, data_group, placement, timeout: as
            :func:`pipeline`'s (``checkpoint`` is the checkpoint mode).
        mesh, reshard_after_forward: as :func:`pipeline`'s: on a ``mesh``, each rank reads
            its partitions' tensors whole, then shards them.
        dtype: the model's dtype, as ``AutoModelForCausalLM.from_pretrained``'s:
            ``"auto"`` (the default; None is the same) builds it in the configuration's
            ``dtype`` (which :func:`save_pretrained` writes), or without one in the
            dtype of the weights' first floating-point tensor; a ``torch.dtype``
            (or its name, ``"bfloat16"``) builds it in that one. The weights' tensors
            are converted to it.
        attn_implementation: ``"eager"``, ``"sdpa"`` ... (default: the model's).
        experts_implementation: a mixture of experts' ``"eager"``, ``"grouped_mm"`` ...
            (default: the model's; torch's grouped matrix product takes no float64).

    Returns:
        The pipeline; its :attr:`~CausalLMPipe.causal_lm` is the model, whose other ranks'
        tensors stay on the meta device.

    Raises:
        FileNotFoundError: ``path`` holds no configuration, no safetensors weights, or
            their index names a file that is missing (the message names it).
        KeyError: the weights lack a tensor of the model (the message names the key
            and the file), or one of the keys transformers converts into one (one expert's,
            named as transformers writes it); a tied copy they do not hold is read from its
            other name.
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
    files = WeightFiles(folder)
    try:
        options: dict[str, Any] = {"dtype": chosen or saved_dtype(config, files)}
        if attn_implementation is not None:
            options["attn_implementation"] = attn_implementation
        if experts_implementation is not None:
            options["experts_implementation"] = experts_implementation
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **options)  # type: ignore[no-untyped-call]
        model.train()
        conversions = Conversions(model, files)
        conversions.check()
        return pipeline(
            model, balance=balance, chunks=chunks, checkpoint=checkpoint, devices=devices,
            group=group, data_group=data_group, placement=placement, timeout=timeout,
            init=Loader(model, conversions), mesh=mesh,
            reshard_after_forward=reshard_after_forward,
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


def save_pretrained(pipe: CausalLMPipe, path: str | os.PathLike[str]) -> None:
    """Write ``pipe``'s model to the directory ``path`` as transformers does: the
    configuration and the tensors in the layout transformers' own ``save_pretrained``
    writes (the model's names, a mixture of experts as one tensor per expert), which
    ``AutoModelForCausalLM.from_pretrained(path)`` and :func:`from_pretrained` load.

    In one process it writes ``config.json`` (with the model's dtype now, as transformers
    writes it, so that a model converted after it was built is read back in its dtype)
    and ``model.safetensors``. Across the ranks
    of the pipeline's ``group``, every rank must call it (a collective): each writes
    ``model-0000<rank+1>-of-0000<ranks>.safetensors`` holding its own tensors (on a file
    system every rank sees), and the first rank the configuration and
    ``model.safetensors.index.json``. With ``data_group``, the first replica writes; the
    others return. A tied copy is written once, as transformers does (the embedding, not
    ``lm_head.weight``); non-persistent buffers are not written; earlier weight files
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
    pipe.save_pretrained(path)
