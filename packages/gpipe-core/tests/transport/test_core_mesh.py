"""GPipe on a device mesh (``mesh=``): the pipeline over ``"pp"``, replicas over
``"dp_replicate"``, each partition sharded with FSDP2 over ``"dp_shard"``, the layers'
tensor parallelism over ``"tp"``.

Four ranks (``cluster4``, started once for the module, its meshes made once per rank),
and eight once (``pp2 x dp_shard2 x tp2``):
``pp2 x dp_shard2`` on every schedule (the zero-bubble ones' split backward included) in
the checkpoint modes the cases name, with a skip between partitions; ``pp2 x
dp_replicate2``; HSDP (``pp1 x dp_replicate2 x dp_shard2``, two partitions on the one
pipeline rank); ``pp2 x tp2`` and ``tp2`` with ``dp_shard2`` or ``dp_replicate2``; a weight
tied across ranks; keyword inputs. Each runs AdamW steps and is compared with the plain
model trained on the whole mini-batch: losses, gathered gradients and parameters after each
step, in float64. Then FSDP's collectives per step, ``clip_grad_norm_`` and a
``BatchMean`` over sharded gradients, a failed step, inference, checkpoints saved on one
mesh and loaded into the plain model, a pipeline without a mesh and another mesh, and the
meshes and modules that are refused, with the module left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

#: Partitions [3, 3]: linear, stash, tanh | linear, pop, linear: a skip from rank to rank.
SKIP = ("linear", "stash", "tanh", "linear", "pop", "linear")
#: Partitions [2, 2, 2, 2]: linear, stash | tanh, linear | pop, linear | tanh, linear: a
#: skip from partition 0 to 2 (one rank with "loop").
SKIP4 = ("linear", "stash", "tanh", "linear", "pop", "linear", "tanh", "linear")
SHARD = ((2, 2), ("pp", "dp_shard"))
REPLICATE = ((2, 2), ("pp", "dp_replicate"))
HSDP = ((1, 2, 2), ("pp", "dp_replicate", "dp_shard"))
LR = 0.05


@pytest.fixture(scope="module")
def cluster4(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(4)


def plain_steps(cases: ModuleType, spec: dict[str, Any], dp: int) -> list[dict[str, Any]]:
    """The plain model's steps: each of ``dp`` data-parallel shares' micro-batch losses, and
    the gradients of the whole mini-batch's mean loss and the parameters after AdamW's
    step."""
    from core_support.mesh_cases import tied_model, tp_model

    if spec.get("tp"):
        model = tp_model(spec["seed"])
    else:
        model = tied_model(cases.build(spec["layers"], spec["seed"]), spec.get("tie"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    steps = []
    for k in range(spec.get("steps", 3)):
        x, y = cases.data(spec["seed"] + k, spec["batch"])
        part = spec["batch"] // dp
        with torch.no_grad():
            losses = [
                [
                    nn.MSELoss()(model(xi), yi).item()
                    for xi, yi in zip(
                        x[d * part : (d + 1) * part].chunk(spec["chunks"]),
                        y[d * part : (d + 1) * part].chunk(spec["chunks"]),
                        strict=True,
                    )
                ]
                for d in range(dp)
            ]
        nn.MSELoss()(model(x), y).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        norm = None
        if spec.get("clip") is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"]).item()
        optimizer.step()
        optimizer.zero_grad()
        values = {name: p.detach().clone() for name, p in model.named_parameters()}
        steps.append({"losses": losses, "grads": grads, "values": values, "norm": norm})
    return steps


def check_mesh_steps(
    cases: ModuleType,
    results: list[dict[str, Any]],
    spec: dict[str, Any],
    shape: tuple[int, ...],
    names: tuple[str, ...] | None = None,
) -> None:
    """Every rank's losses (its data-parallel share's), and the gradients and parameters of
    its partitions (whole), equal the plain model's at every step; every parameter is on
    some rank. ``names``: the mesh's (default: ``"pp"`` then data-parallel dimensions)."""
    from core_support.mesh_cases import data_share

    names = names or ("pp", *(f"dp_{k}" for k in range(len(shape) - 1)))
    dp = data_share(0, shape, names)[1]
    for k, want in enumerate(plain_steps(cases, spec, dp)):
        seen: set[str] = set()
        for rank, result in enumerate(results):
            got = result["steps"][k]
            share = data_share(rank, shape, names)[0]
            torch.testing.assert_close(got["losses"], want["losses"][share], msg=f"rank {rank}")
            if want["norm"] is not None:
                torch.testing.assert_close(got["norm"], want["norm"], msg=f"rank {rank}")
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, want["grads"][name], msg=f"{name}, step {k}")
                torch.testing.assert_close(
                    got["values"][name], want["values"][name], msg=f"{name} after step {k}"
                )
                seen.add(name)
        assert seen == want["grads"].keys()


SCHEDULES = [
    # (schedule, placement, balance, layers, checkpoint)
    ("gpipe", None, [3, 3], SKIP, "except_last"),
    ("gpipe", None, [3, 3], SKIP, "always"),
    ("gpipe", None, [3, 3], SKIP, "never"),
    ("1f1b", None, [3, 3], SKIP, "except_last"),
    ("1f1b", None, [3, 3], SKIP, "always"),
    ("interleaved-1f1b", "loop", [2, 2, 2, 2], SKIP4, "except_last"),
    ("gpipe", "v", [2, 2, 2, 2], SKIP4, "never"),
    ("1f1b", "v", [2, 2, 2, 2], SKIP4, "always"),
    ("interleaved-1f1b", "loop", [2, 2, 2, 2], SKIP4, "always"),
    ("zb-h1", "loop", [2, 2, 2, 2], SKIP4, "except_last"),
    ("zb-h1", "loop", [2, 2, 2, 2], SKIP4, "never"),
    ("zbv", "v", [2, 2, 2, 2], SKIP4, "always"),
    ("zbv", "v", [2, 2, 2, 2], SKIP4, "never"),
]


@pytest.mark.parametrize(
    ("schedule", "placement", "balance", "layers", "checkpoint"),
    SCHEDULES,
    ids=[f"{s}-{p}-{c}" for s, p, _, _, c in SCHEDULES],
)
def test_pp2_dp_shard2_matches_plain_over_three_optimizer_steps(
    cluster4: Any,
    cases: ModuleType,
    schedule: str,
    placement: str | None,
    balance: list[int],
    layers: tuple[str, ...],
    checkpoint: str,
) -> None:
    shape, names = SHARD
    spec = {"layers": layers, "seed": 3, "batch": 8, "chunks": 2}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=balance, schedule=schedule,
        placement=placement, checkpoint=checkpoint, **spec,
    )  # fmt: skip
    for result in results:  # each rank holds half of each parameter
        for name, local in result["steps"][0]["sharded"].items():
            assert local is not None and local[0] == 2, (name, local)
    check_mesh_steps(cases, results, spec, shape)


def test_a_mesh_of_pp_alone_is_a_pipeline_across_its_ranks(
    cluster4: Any, cases: ModuleType
) -> None:
    spec = {"layers": SKIP4, "seed": 15, "batch": 8, "chunks": 4}
    results = cluster4.results(
        "mesh_steps", shape=(4,), names=("pp",), balance=[2, 2, 2, 2], schedule="1f1b",
        count=True, **spec,
    )  # fmt: skip
    for result in results:
        assert all(local is None for local in result["steps"][0]["sharded"].values())
        assert result["steps"][0]["counts"]["all_reduce"] == 0
    check_mesh_steps(cases, results, spec, (4,))


def test_pp2_dp_replicate2_averages_as_data_group_does(cluster4: Any, cases: ModuleType) -> None:
    """The replicas' gradients averaged by gpipe after each step, one all_reduce per step
    and dtype, on whole (unsharded) parameters."""
    shape, names = REPLICATE
    spec = {"layers": SKIP, "seed": 4, "batch": 8, "chunks": 2}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], schedule="1f1b", count=True,
        **spec,
    )  # fmt: skip
    for result in results:
        for step in result["steps"]:
            assert step["counts"] == {
                "reduce_scatter_single": 0, "all_gather_single": 0, "all_reduce": 1,
            }, step["counts"]  # fmt: skip
            assert all(local is None for local in step["sharded"].values())
    check_mesh_steps(cases, results, spec, shape)


def test_hsdp_with_two_partitions_on_the_one_pipeline_rank(
    cluster4: Any, cases: ModuleType
) -> None:
    """pp1 x dp_replicate2 x dp_shard2: both partitions on one rank (placement "loop"),
    each sharded over dp_shard and all-reduced over dp_replicate by FSDP: once per step
    each. Each step clips the gradients by the whole model's norm."""
    shape, names = HSDP
    spec = {"layers": SKIP, "seed": 5, "batch": 8, "chunks": 2, "clip": 0.1}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], placement="loop", count=True,
        checkpoint="always", **spec,
    )  # fmt: skip
    for result in results:
        for step in result["steps"]:
            counts = step["counts"]
            assert counts["reduce_scatter_single"] == 2, counts  # one per partition
            assert counts["all_reduce"] == 2, counts
    check_mesh_steps(cases, results, spec, shape)


@pytest.mark.parametrize(
    ("reshard_after_forward", "gathers"),
    # chunks=2, checkpoint="except_last": with resharding, each micro-batch's forward and
    # backward pass gathers (a recomputation shares its backward pass's); without, the
    # first forward pass gathers for the whole step.
    [(None, 4), (True, 4), (False, 1)],
)
def test_gradients_are_reduce_scattered_once_per_step_per_partition(
    cluster4: Any, cases: ModuleType, reshard_after_forward: bool | None, gathers: int
) -> None:
    shape, names = SHARD
    spec = {"layers": SKIP, "seed": 6, "batch": 8, "chunks": 2}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], count=True,
        reshard_after_forward=reshard_after_forward, **spec,
    )  # fmt: skip
    for result in results:
        for step in result["steps"]:
            assert step["counts"] == {
                "reduce_scatter_single": 1, "all_gather_single": gathers, "all_reduce": 0,
            }, step["counts"]  # fmt: skip
    check_mesh_steps(cases, results, spec, shape)


def test_a_profile_shows_each_collective_inside_the_task_that_issues_it(
    cluster4: Any, cases: ModuleType
) -> None:
    # torch.profiler's trace of a step: FSDP's all-gathers inside the partition's forward
    # and backward tasks (one in each, with resharding; chunks=2, no checkpointing), and
    # its one reduction in a range of its own, after the partition's last backward task
    # (whose gradient is sent first).
    shape, names = SHARD
    spec = {"layers": SKIP, "seed": 6, "batch": 8, "chunks": 2, "checkpoint": "never", "steps": 1}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], profiled=True, **spec
    )
    for rank, result in enumerate(results):
        j = rank // 2  # mesh (pp, dp_shard): ranks 0 and 1 hold partition 0
        shown = result["steps"][0]["collectives"]
        tasks = [f"gpipe/{phase}/p{j}/mb{i}" for phase in ("backward", "forward") for i in (0, 1)]
        assert sorted(shown["FSDP::all_gather"]) == tasks, (rank, shown)
        assert shown["FSDP::post_backward_reduce"] == [f"gpipe/reduce/p{j}"], (rank, shown)
        # GPipe's schedule runs the backward passes last micro-batch first: mb0's is last.
        labels = result["steps"][0]["labels"]
        assert labels[-2:] == [f"gpipe/backward/p{j}/mb0", f"gpipe/reduce/p{j}"], (rank, labels)
    check_mesh_steps(cases, results, spec, shape)


def test_clip_grad_norm_over_sharded_gradients_is_the_plain_models(
    cluster4: Any, cases: ModuleType
) -> None:
    shape, names = SHARD
    spec = {"layers": SKIP, "seed": 8, "batch": 8, "chunks": 2, "steps": 1}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], clip=0.05, **spec
    )
    model = cases.build(SKIP, 8)
    x, y = cases.data(8, 8)
    nn.MSELoss()(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    for result in results:
        step = result["steps"][0]
        torch.testing.assert_close(step["norm"], norm.item())
        for name, grad in step["clipped"].items():
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, msg=name)


@pytest.mark.parametrize(
    ("schedule", "placement"), [("interleaved-1f1b", "loop"), ("zb-h1", "loop"), ("zbv", "v")]
)
def test_two_sharded_partitions_per_rank_reduce_scatter_once_each(
    cluster4: Any, schedule: str, placement: str
) -> None:
    """Two partitions per rank, four micro-batches: one reduce-scatter per partition per
    step; a split backward (``I`` and ``W``) keeps each partition's parameters gathered
    from its first forward pass to its reduction (one all-gather each)."""
    shape, names = SHARD
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, layers=SKIP4, balance=[2, 2, 2, 2], seed=7,
        batch=8, chunks=4, steps=1, placement=placement, schedule=schedule, count=True,
    )  # fmt: skip
    for result in results:
        counts = result["steps"][0]["counts"]
        assert counts["reduce_scatter_single"] == 2, counts
        if schedule != "interleaved-1f1b":
            assert counts["all_gather_single"] == 2, counts


ERRORS = {
    "no_pp": ("ValueError", "mesh must have a 'pp' dimension"),
    "unknown": ("ValueError", "mesh has dimension 'fsdp', which gpipe does not know"),
    "cp": ("ValueError", "mesh has dimension 'cp', and context parallelism ('cp') is not"),
    "dtensor_elsewhere": ("TypeError", "'0.weight' is a DTensor on another mesh"),
    "pp_size": ("ValueError", "mesh['pp'] must have one rank per worker of the partitions"),
    "fsdp1": ("TypeError", "module '2' is wrapped in FSDP1's FullyShardedDataParallel"),
    "fully_shard": ("TypeError", "module '2' is fully_shard-ed already"),
    "group": ("ValueError", "mesh replaces group and data_group: pass either mesh or group"),
    "data_group": ("ValueError", "pass either mesh or data_group"),
    "tied": ("ValueError", "a tensor tied between partitions of one rank cannot be sharded"),
    "reshard_without_shard": ("ValueError", "reshard_after_forward applies to partitions"),
    "not_a_mesh": ("TypeError", "mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    "order": ("ValueError", "mesh must have 'dp_replicate' before 'dp_shard'"),
}


@pytest.mark.parametrize("how", list(ERRORS))
def test_what_a_mesh_cannot_run_is_refused_before_anything_changes(cluster4: Any, how: str) -> None:
    kind, words = ERRORS[how]
    for rank, result in enumerate(cluster4.results("mesh_error", how=how)):
        assert result["type"] == kind, (rank, result)
        assert words in result["message"], (rank, result["message"])
        assert result["unchanged"], (rank, how)


@pytest.mark.parametrize(
    ("mesh", "placement"), [(SHARD, None), (HSDP, "loop")], ids=["pp2-dp_shard2", "hsdp"]
)
def test_batch_mean_counts_over_every_data_parallel_rank(
    cluster4: Any, cases: ModuleType, mesh: Any, placement: str | None
) -> None:
    """Each data-parallel rank keeps its own count of targets of its 8 (ignored ones
    -100): each micro-batch is divided by the count of every rank's together, and the
    gradients are the plain model's on the whole mini-batch."""
    shape, _ = mesh
    dp = 4 // shape[0]
    results = cluster4.results(
        "batch_mean", schedule="1f1b", placement=placement, seed=5, mesh=mesh
    )
    model = cases.classifier(5)
    x, y = cases.ignored_targets(5, 8 * dp)
    nn.CrossEntropyLoss()(model(x), y).backward()
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            if name in grads:  # another data-parallel rank's: the same whole gradient
                torch.testing.assert_close(grad, grads[name], msg=name)
            grads[name] = grad
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_keyword_inputs_reach_a_sharded_first_partition(cluster4: Any, cases: ModuleType) -> None:
    """A first layer called with keyword inputs: the sharded partition is called as one
    module (FSDP's hooks gather its parameters), with the plain model's numbers."""
    shape, names = SHARD
    spec = {"layers": ("todict", "frommap", "tanh", "linear"), "seed": 9, "batch": 8,
            "chunks": 2, "steps": 2}  # fmt: skip
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[2, 2], keywords=True, **spec
    )
    check_mesh_steps(cases, results, spec, shape)


@pytest.mark.parametrize("mesh", [SHARD, REPLICATE], ids=["dp_shard", "dp_replicate"])
def test_a_weight_tied_across_ranks_stays_tied_over_three_steps(
    cluster4: Any, cases: ModuleType, mesh: Any
) -> None:
    """Layer 5's weight is layer 0's, across the pipeline's ranks: each rank's replica
    (sharded alike on the ranks of one shard coordinate) gets the summed gradient, and
    AdamW keeps the replicas the plain model's one weight."""
    shape, names = mesh
    spec = {"layers": SKIP, "seed": 10, "batch": 8, "chunks": 2, "tie": (0, 5)}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], schedule="1f1b", **spec
    )
    check_mesh_steps(cases, results, spec, shape)
    assert all(result["drift"] == {"0.weight": 0.0} for result in results), results[0]["drift"]


def test_after_a_failed_step_the_next_steps_are_the_plain_models(
    cluster4: Any, cases: ModuleType
) -> None:
    """The last partition fails in the backward pass of micro-batch 0, its last of the
    step, after micro-batch 1's (whose unsharded gradients FSDP holds, unreduced): every
    rank raises, the held gradients are dropped, and the steps after it are exact."""
    shape, names = SHARD
    layers = ("linear", "stash", "tanh", "linear", "trap", "pop", "linear")
    spec = {"layers": layers, "seed": 11, "batch": 8, "chunks": 2}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 4], checkpoint="never",
        fail_first=True, **spec,
    )  # fmt: skip
    for rank, result in enumerate(results):
        assert result["failed"] is not None, rank
        assert "Fail: backward" in result["failed"], (rank, result["failed"])
    check_mesh_steps(cases, results, spec, shape)


def test_inference_on_a_mesh(cluster4: Any, cases: ModuleType) -> None:
    """forward() in eval mode without grad: each data-parallel rank's share through the
    sharded partitions, the output on the last partition's ranks."""
    shape, names = SHARD
    spec = {"layers": SKIP, "seed": 12, "batch": 8, "chunks": 2, "steps": 1}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], infer=True, **spec
    )
    check_mesh_steps(cases, results, spec, shape)
    model = cases.build(SKIP, 12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = cases.data(12, 8)
    nn.MSELoss()(model(x), y).backward()
    optimizer.step()
    with torch.no_grad():
        for rank, result in enumerate(results):
            if rank // 2 == 0:  # the first partition's ranks
                assert result["output"] is None, rank
                continue
            part = slice((rank % 2) * 4, (rank % 2 + 1) * 4)
            torch.testing.assert_close(result["output"], model(x[part]), msg=f"rank {rank}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_from_the_mesh_loads_into_the_plain_model_pp4_and_another_mesh(
    cluster4: Any, cases: ModuleType, tmp_path: Any
) -> None:
    """``torch.distributed.checkpoint`` saves the sharded state dict (DTensors) of
    ``pp2 x dp_shard2`` after two steps; it loads into the plain model in this process,
    into a pipeline of four ranks without a mesh, and into HSDP on ``pp1 x dp_replicate2 x
    dp_shard2`` (built on the meta device): the trained parameters, whole."""
    import torch.distributed.checkpoint as dcp

    shape, names = SHARD
    path = str(tmp_path / "checkpoint")
    spec = {"layers": SKIP, "seed": 13, "batch": 8, "chunks": 2, "steps": 2}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], save=path, **spec
    )
    trained = {k: v for result in results for k, v in result["steps"][-1]["values"].items()}
    plain = cases.build(SKIP, 99)
    state = plain.state_dict()
    assert state.keys() == trained.keys()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    for key, value in trained.items():
        torch.testing.assert_close(plain.state_dict()[key], value, msg=key)
    loaded = cluster4.results("load", layers=SKIP, balance=[2, 2, 1, 1], path=path, batch=6)
    for result in loaded:
        for key, value in result["state"].items():
            torch.testing.assert_close(value, trained[key], msg=key)
    x, _ = cases.data(1, 6)
    torch.testing.assert_close(loaded[3]["output"], plain.eval()(x))
    # Into another mesh: HSDP, both partitions on the one pipeline rank.
    shape, names = HSDP
    into = cluster4.results(
        "mesh_load", shape=shape, names=names, layers=SKIP, balance=[3, 3], path=path,
        placement="loop",
    )  # fmt: skip
    for result in into:
        assert result["values"].keys() == trained.keys()
        for key, value in result["values"].items():
            torch.testing.assert_close(value, trained[key], msg=key)


def test_training_resumes_on_another_mesh_from_the_model_and_optimizer_state(
    cluster4: Any, cases: ModuleType, tmp_path: Any
) -> None:
    """Two steps on ``pp2 x dp_shard2``, the model's and AdamW's state saved through
    ``get_state_dict`` and ``torch.distributed.checkpoint``; on HSDP (another mesh, both
    partitions on one rank) ``set_state_dict`` loads them and the third step is the plain
    model's third."""
    path = str(tmp_path / "resume")
    spec = {"layers": SKIP, "seed": 14, "batch": 8, "chunks": 2}
    shape, names = SHARD
    cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], steps=2, save_all=path, **spec
    )
    shape, names = HSDP
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], placement="loop", steps=1,
        first_step=2, resume=path, **spec,
    )  # fmt: skip
    want = plain_steps(cases, {**spec, "steps": 3}, 4)[2]
    for rank, result in enumerate(results):
        got = result["steps"][0]
        torch.testing.assert_close(got["losses"], want["losses"][rank], msg=f"rank {rank}")
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, want["grads"][name], msg=name)
            torch.testing.assert_close(got["values"][name], want["values"][name], msg=name)


def test_a_pipeline_without_a_mesh_does_not_import_fsdp() -> None:
    """FSDP and DTensor are imported where a mesh shards: a step and a clipping without
    one, in a fresh process, leave them out."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from gpipe_core import GPipe\n"
        "model = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], chunks=2)\n"
        "model.step(torch.randn(4, 2), torch.randn(4, 2), nn.MSELoss(), schedule='1f1b')\n"
        "model.clip_grad_norm_(1.0)\n"
        "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


TP = ((2, 2), ("pp", "tp"))


def test_pp2_tp2_with_a_column_and_row_parallel_pair_matches_plain(
    cluster4: Any, cases: ModuleType
) -> None:
    """Each partition a column-parallel and a row-parallel linear layer (parallelized over
    mesh["tp"] before the pipeline is built); the ranks of a tensor-parallel group pass the
    same data, and what crosses between partitions is what the row-parallel layer returns
    (whole). Three AdamW steps on the DTensor parameters: the plain model's."""
    shape, names = TP
    spec = {"layers": (), "seed": 16, "batch": 8, "chunks": 2, "tp": True}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], schedule="1f1b", infer=True,
        **spec,
    )  # fmt: skip
    for result in results:  # each rank holds half of each weight (8 x 4 or 4 x 8)
        step = result["steps"][0]
        for name, local in step["sharded"].items():
            if name.endswith("weight"):
                assert local is not None and local[0] * local[1] == 16, (name, local)
    check_mesh_steps(cases, results, spec, shape, names)
    # Then inference: the last step's mini-batch through the trained model, whole on the
    # last partition's ranks.
    from core_support.mesh_cases import tp_model

    model = tp_model(16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for k in range(3):
        x, y = cases.data(16 + k, 8)
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        for rank, result in enumerate(results):
            if rank >= 2:
                torch.testing.assert_close(result["output"], model(x), msg=f"rank {rank}")


@pytest.mark.parametrize(
    ("mesh", "checkpoint"),
    [
        (((1, 2, 2), ("pp", "dp_shard", "tp")), "always"),
        (((1, 2, 2), ("pp", "dp_replicate", "tp")), "except_last"),
    ],
    ids=["dp_shard2-tp2", "dp_replicate2-tp2"],
)
def test_tensor_parallel_layers_with_data_parallel_replicas_or_shards(
    cluster4: Any, cases: ModuleType, mesh: Any, checkpoint: str
) -> None:
    """pp1 x dp2 x tp2, both partitions on the one pipeline rank: over "dp_shard", FSDP
    shards the tensor-parallel parameters again (2D); over "dp_replicate", gpipe averages
    their local parts. Each step clips by the whole model's norm."""
    shape, names = mesh
    spec = {"layers": (), "seed": 17, "batch": 8, "chunks": 2, "tp": True, "clip": 0.1}
    results = cluster4.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], placement="loop",
        checkpoint=checkpoint, **spec,
    )  # fmt: skip
    check_mesh_steps(cases, results, spec, shape, names)


@pytest.fixture(scope="module")
def cluster8(new_cluster_module: Callable[[int], Any]) -> Any:
    return new_cluster_module(8)


def test_pp2_dp_shard2_tp2_on_eight_ranks(cluster8: Any, cases: ModuleType) -> None:
    """The three dimensions at once, once (eight ranks): each pipeline rank's
    tensor-parallel layers sharded again by FSDP over "dp_shard", two AdamW steps equal
    to the plain model's."""
    shape, names = (2, 2, 2), ("pp", "dp_shard", "tp")
    spec = {"layers": (), "seed": 18, "batch": 8, "chunks": 2, "tp": True, "steps": 2}
    results = cluster8.results(
        "mesh_steps", shape=shape, names=names, balance=[3, 3], checkpoint="except_last",
        **spec,
    )  # fmt: skip
    check_mesh_steps(cases, results, spec, shape, names)
