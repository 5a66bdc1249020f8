"""GPipe.step when things go wrong: exceptions in any task, bad arguments, forward-only runs.

Every failing step runs in a helper thread joined with a deadline, so a hang fails the
test instead of hanging the suite. After a failure the model must run the next step
exactly like the plain model, with no extra thread or tensor left behind.
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from core_support.models import MODES, Pop, Stash
from gpipe_bn import DeferredBatchNorm
from gpipe_checkpoint import is_recomputing
from gpipe_core import GPipe

WIDTH = 4
DEADLINE_S = 60
THIS_FILE = Path(__file__).resolve()


class Boom(Exception):
    """The error the tests raise, so that nothing else can be mistaken for it."""


class Interrupt(BaseException):
    """Not an Exception: like KeyboardInterrupt or SystemExit."""


def thread_count() -> int:
    """The live threads, once the workers of collected pipelines have exited."""
    gc.collect()
    count = threading.active_count()
    for _ in range(100):
        time.sleep(0.01)
        if threading.active_count() == count:
            break
        count = threading.active_count()
    return count


def run_with_deadline(function: Callable[[], Any]) -> Any:
    """Run ``function`` in a helper thread; return its result or raise what it raised."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = function()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    runner.join(timeout=DEADLINE_S)
    assert not runner.is_alive(), f"the step did not return within {DEADLINE_S} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


class RaiseOn(nn.Module):
    """Identity that raises ``error`` on its ``call``-th forward call (recomputations skipped).

    ``in_recompute``: raise in the recomputation of a checkpointed micro-batch instead.
    """

    def __init__(
        self, error: BaseException | None = None, call: int = 0, in_recompute: bool = False
    ) -> None:
        super().__init__()
        self.error = error
        self.call = call
        self.in_recompute = in_recompute
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            if self.in_recompute and is_recomputing():
                raise self.error
            if not self.in_recompute and not is_recomputing():
                self.calls += 1
                if self.calls == self.call + 1:
                    raise self.error
        return x


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("backward failed")


class RaiseInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailingBackward.apply(x) if self.armed else x


def layers(middle: nn.Module, where: int) -> nn.Sequential:
    """Three partitions of [linear, tanh]; ``middle`` first in partition ``where``."""
    torch.manual_seed(0)
    made: list[nn.Module] = []
    for j in range(3):
        if j == where:
            made.append(middle)
        made += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*made).double()


def balance(where: int) -> list[int]:
    return [3 if j == where else 2 for j in range(3)]


def data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(batch, WIDTH, dtype=torch.float64),
        torch.randn(batch, WIDTH, dtype=torch.float64),
    )


def disarm(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, RaiseOn):
            module.error = None
        if isinstance(module, RaiseInBackward):
            module.armed = False


def assert_next_step_matches_plain(pipe: GPipe, plain: nn.Module, schedule: str) -> None:
    """Zero the grads, step both models, compare losses and grads."""
    disarm(pipe)
    disarm(plain)
    for module in (pipe, plain):
        module.zero_grad(set_to_none=True)
    x, y = data()
    x_pipe, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    losses = run_with_deadline(lambda: pipe.step(x_pipe, y, nn.MSELoss(), schedule=schedule))
    expected = nn.MSELoss()(plain(x_plain), y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    torch.testing.assert_close(x_pipe.grad, x_plain.grad)
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def assert_raised_here(excinfo: pytest.ExceptionInfo[BaseException], function: str) -> None:
    """The traceback reaches the frame of ``function`` in this file, where it raised."""
    frames = [(Path(str(entry.path)).resolve(), entry.name) for entry in excinfo.traceback]
    assert (THIS_FILE, function) in frames, frames


def fail_and_recover(
    pipe: GPipe,
    plain: nn.Module,
    error: type[BaseException],
    message: str,
    raising_function: str,
    *,
    schedule: str,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    arm: Callable[[], None] | None = None,
) -> None:
    """Warm up, ``arm``, fail with ``error(message)`` raised in ``raising_function``, recover."""
    # One step first, so that the workers exist before threads are counted.
    run_with_deadline(lambda: pipe.step(*data(), nn.MSELoss(), schedule=schedule))
    if arm is not None:
        arm()
    threads = thread_count()
    x, y = data()
    with pytest.raises(error) as excinfo:
        run_with_deadline(
            lambda: pipe.step(x.requires_grad_(), y, loss_fn or nn.MSELoss(), schedule=schedule)
        )
    assert type(excinfo.value) is error
    assert str(excinfo.value) == message
    assert_raised_here(excinfo, raising_function)
    assert thread_count() == threads
    assert_next_step_matches_plain(pipe, plain, schedule)
    assert thread_count() == threads


SCHEDULES = ("gpipe", "1f1b")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
@pytest.mark.parametrize("microbatch", [0, 2, 3])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_error_in_forward(where: int, microbatch: int, checkpoint: str, schedule: str) -> None:
    model = layers(RaiseOn(), where)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(where), chunks=4, checkpoint=checkpoint)
    model[where * 2].error = Boom(f"forward failed on micro-batch {microbatch}")
    model[where * 2].call = microbatch + 4  # after the warm-up step's 4 calls
    fail_and_recover(
        pipe,
        plain,
        Boom,
        f"forward failed on micro-batch {microbatch}",
        "forward",
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_error_in_forward_of_one_partition(schedule: str) -> None:
    model = layers(RaiseOn(), 0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [7], chunks=3)  # one partition: the step runs in the caller's thread
    model[0].error = Boom("alone")
    model[0].call = 4
    fail_and_recover(pipe, plain, Boom, "alone", "forward", schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_error_in_loss_fn(checkpoint: str, schedule: str) -> None:
    model = layers(RaiseOn(), 0)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(0), chunks=4, checkpoint=checkpoint)
    calls = []

    def failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(len(output))
        if len(calls) == 2:
            raise Boom("loss failed")
        return nn.functional.mse_loss(output, target)

    fail_and_recover(
        pipe, plain, Boom, "loss failed", "failing_loss", schedule=schedule, loss_fn=failing_loss
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_error_in_backward(where: int, checkpoint: str, schedule: str) -> None:
    raising = RaiseInBackward()
    model = layers(raising, where)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(where), chunks=4, checkpoint=checkpoint)

    def arm() -> None:
        raising.armed = True

    fail_and_recover(pipe, plain, Boom, "backward failed", "backward", schedule=schedule, arm=arm)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("where", [0, 1, 2])
def test_error_in_recomputation(where: int, schedule: str) -> None:
    model = layers(RaiseOn(), where)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(where), chunks=4, checkpoint="always")

    def arm() -> None:
        model[where * 2].error = Boom("recomputation failed")
        model[where * 2].in_recompute = True

    fail_and_recover(
        pipe, plain, Boom, "recomputation failed", "forward", schedule=schedule, arm=arm
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("where", [0, 2])
def test_base_exception_in_a_worker(where: int, schedule: str) -> None:
    model = layers(RaiseOn(), where)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(where), chunks=4)
    model[where * 2].error = Interrupt("stop")
    model[where * 2].call = 5
    fail_and_recover(pipe, plain, Interrupt, "stop", "forward", schedule=schedule)


# -- bad arguments -------------------------------------------------------------------------


@pytest.fixture(name="pipe")
def pipe_fixture() -> GPipe:
    return GPipe(layers(RaiseOn(), 0), balance(0), chunks=2)


def test_target_batch_size_mismatch(pipe: GPipe) -> None:
    x, y = data(6)
    with pytest.raises(
        ValueError, match=r"target must have the input's batch size \(input: 6, target: 5\)"
    ):
        pipe.step(x, y[:5], nn.MSELoss())


def test_loss_fn_not_callable(pipe: GPipe) -> None:
    with pytest.raises(TypeError, match=r"loss_fn must be callable \(loss_fn: str\)"):
        pipe.step(*data(), "mse")  # type: ignore[arg-type]


def test_reduction_none(pipe: GPipe) -> None:
    with pytest.raises(ValueError, match=r"'mean' or 'sum' \(loss_fn.reduction: 'none'\)"):
        pipe.step(*data(), nn.MSELoss(reduction="none"))
    with pytest.raises(
        ValueError, match=r"reduction must be 'mean' or 'sum' \(reduction: 'none'\)"
    ):
        pipe.step(*data(), nn.MSELoss(), reduction="none")  # type: ignore[arg-type]


def test_reduction_contradicting_the_loss(pipe: GPipe) -> None:
    for before in pipe.parameters():
        before.grad = None
    with pytest.raises(
        ValueError,
        match=r"reduction must match loss_fn.reduction when loss_fn has one "
        r"\(reduction: 'sum', loss_fn.reduction: 'mean'\)",
    ):
        pipe.step(*data(), nn.MSELoss(), reduction="sum")
    assert all(p.grad is None for p in pipe.parameters())  # refused before any work
    pipe.step(*data(), nn.MSELoss(reduction="sum"), reduction="sum")  # agreeing is fine


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_non_scalar_loss(pipe: GPipe, schedule: str) -> None:
    def per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).square().mean(1)

    with pytest.raises(
        ValueError,
        # The first loss computed: micro-batch 1's with 'gpipe' (micro-batch 0 is
        # checkpointed, its loss comes after its recomputation), micro-batch 0's with '1f1b'.
        match=r"must return a scalar tensor \(micro-batch [01], loss_fn returned: shape \(4,\)\)",
    ):
        run_with_deadline(
            lambda: pipe.step(*data(), per_sample, reduction="mean", schedule=schedule)
        )
    with pytest.raises(ValueError, match=r"loss_fn returned: float\)"):
        run_with_deadline(lambda: pipe.step(*data(), lambda o, t: 1.0, schedule=schedule))  # type: ignore[arg-type, return-value]
    plain = layers(RaiseOn(), 0)
    assert_next_step_matches_plain(pipe, plain, schedule)


def test_unknown_schedule(pipe: GPipe) -> None:
    with pytest.raises(
        ValueError,
        match=r"schedule must be one of \['1f1b', 'gpipe', .*'zbv'\] \(schedule: 'interleaved'\)",
    ):
        pipe.step(*data(), nn.MSELoss(), schedule="interleaved")
    assert all(p.grad is None for p in pipe.parameters())


def test_input_on_the_wrong_device(pipe: GPipe) -> None:
    x, y = data()
    with pytest.raises(
        ValueError,
        match=r"input must be on the first partition's device \(devices\[0\]: cpu, input: meta\)",
    ):
        pipe.step(x.to("meta"), y, nn.MSELoss())
    with pytest.raises(ValueError, match=r"input\[1\] must be on the first partition's device"):
        pipe.step((x, x.to("meta")), y, nn.MSELoss())


def test_input_not_a_tensor(pipe: GPipe) -> None:
    with pytest.raises(TypeError, match="input"):
        pipe.step([1, 2], torch.zeros(2), nn.MSELoss())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="target"):
        pipe.step(data()[0], "y", nn.MSELoss())  # type: ignore[arg-type]


# -- forward only --------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_forward_only(mode: str, checkpoint: str, schedule: str) -> None:
    model = layers(nn.Dropout(0.5), 1)
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(model, balance(1), chunks=3, checkpoint=checkpoint)
    x, y = data(8)
    x.requires_grad_()
    pipe.eval()  # no dropout, to compare with the plain model; grad mode is what matters
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def forward_only_step() -> Any:
        with context():
            return pipe.step(x, y, nn.MSELoss(), schedule=schedule)

    losses = run_with_deadline(forward_only_step)
    with torch.no_grad():
        expected = [
            nn.MSELoss()(plain(xi), yi) for xi, yi in zip(x.split(3), y.split(3), strict=True)
        ]
    assert losses.sizes == (3, 3, 2)
    torch.testing.assert_close(list(losses), expected)
    assert all(not loss.requires_grad for loss in losses)
    assert x.grad is None
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_eval_mode_step_computes_gradients(checkpoint: str, schedule: str) -> None:
    """Fine-tuning in eval mode (dropout off, batch norm on its running statistics): the
    step computes the gradients ``loss.backward()`` computes on the plain model in eval
    mode (it computed none before)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.5), nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
    ).double()  # fmt: skip
    model[1].running_mean.uniform_()
    plain = copy.deepcopy(model).eval()
    pipe = GPipe(model, [2, 3], chunks=3, checkpoint=checkpoint).eval()
    x, y = data(8)
    x.requires_grad_()
    plain_x = x.detach().clone().requires_grad_()
    losses = run_with_deadline(lambda: pipe.step(x, y, nn.MSELoss(), schedule=schedule))
    expected = nn.MSELoss()(plain(plain_x), y)
    expected.backward()
    torch.testing.assert_close(losses.reduced(), expected.detach())
    for (name, got), want in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad)
    torch.testing.assert_close(x.grad, plain_x.grad)
    # Batch norm used its running statistics and did not update them.
    torch.testing.assert_close(pipe[1].running_mean, plain[1].running_mean)


def test_no_grad_in_training_mode_runs_forward_only() -> None:
    model = layers(RaiseOn(), 1)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance(1), chunks=4, checkpoint="always")
    x, y = data()
    with torch.no_grad():
        losses = pipe.step(x, y, nn.MSELoss(), schedule="1f1b")
    torch.testing.assert_close(losses.reduced(), nn.MSELoss()(plain(x), y).detach())
    assert all(p.grad is None for p in pipe.parameters())


# -- deferred batch norm, leaks --------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_failed_step_leaves_deferred_statistics_unchanged(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)
    ).double()
    pipe = GPipe(model, [2, 2], chunks=4, deferred_batch_norm=True)
    norm = next(m for m in pipe.modules() if isinstance(m, DeferredBatchNorm))
    pipe.step(*data(), nn.MSELoss(), schedule=schedule)
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    calls = []

    def failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        if len(calls) == 4:
            raise Boom("last micro-batch")
        return nn.functional.mse_loss(output, target)

    with pytest.raises(Boom, match="last micro-batch"):
        run_with_deadline(lambda: pipe.step(*data(), failing_loss, schedule=schedule))
    after = norm.state_dict()
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert norm.pending == 0
    # The next step counts as one mini-batch.
    pipe.step(*data(), nn.MSELoss(), schedule=schedule)
    assert int(norm.num_batches_tracked) == int(before["num_batches_tracked"]) + 1


def live_tensors() -> int:
    gc.collect()
    # type(), not isinstance(): the latter touches deprecated torch objects, which warn.
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_no_tensor_or_thread_leak_over_many_steps(checkpoint: str) -> None:
    raising = RaiseOn()
    model = layers(raising, 1)
    pipe = GPipe(model, balance(1), chunks=4, checkpoint=checkpoint)
    x, y = data()

    def steps(count: int) -> None:
        for k in range(count):
            schedule = SCHEDULES[k % 2]
            if k % 10 == 9:
                raising.error, raising.calls, raising.call = Boom("leak?"), 0, 2
                with pytest.raises(Boom):
                    pipe.step(x, y, nn.MSELoss(), schedule=schedule)
                raising.error = None
            else:
                pipe.step(x, y, nn.MSELoss(), schedule=schedule)
            pipe.zero_grad(set_to_none=False)

    steps(10)
    threads, tensors = thread_count(), live_tensors()
    run_with_deadline(lambda: steps(100))
    assert thread_count() == threads
    assert live_tensors() <= tensors


# -- errors with skips in flight -------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("where", [0, 1, 2, 3])
def test_error_while_a_skip_is_in_flight(where: int, checkpoint: str, schedule: str) -> None:
    # Partitions: [stash, linear] [tanh, linear] [pop] [linear], the raising layer first
    # in partition ``where``: a skip from partition 0 to 2 is on its way when it raises.
    torch.manual_seed(0)
    parts: list[list[nn.Module]] = [
        [Stash(), nn.Linear(WIDTH, WIDTH)],
        [nn.Tanh(), nn.Linear(WIDTH, WIDTH)],
        [Pop()],
        [nn.Linear(WIDTH, WIDTH)],
    ]
    raising = RaiseOn()
    parts[where].insert(0, raising)
    model = nn.Sequential(*[layer for part in parts for layer in part]).double()
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [len(part) for part in parts], chunks=4, checkpoint=checkpoint)

    def arm() -> None:
        raising.error, raising.calls, raising.call = Boom("with a skip"), 0, 1

    fail_and_recover(pipe, plain, Boom, "with a skip", "forward", schedule=schedule, arm=arm)


# -- an interrupt in the calling thread ------------------------------------------------------

# Run in a fresh interpreter: a step that hangs here would keep its threads alive and
# disturb every later test that counts threads.
INTERRUPT_SCRIPT = """
import copy, ctypes, sys, threading, time
import torch
from torch import nn
from gpipe_core import GPipe

class Interrupt(BaseException):
    pass

class Slow(nn.Module):
    def forward(self, x):
        time.sleep(0.02)
        return x

schedule = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), Slow(), nn.Linear(4, 4), Slow(), nn.Linear(4, 4)).double()
plain = copy.deepcopy(model)
pipe = GPipe(model, [2, 2, 1], chunks=8)
x = torch.randn(16, 4, dtype=torch.float64)
y = torch.randn(16, 4, dtype=torch.float64)
pipe.step(x, y, nn.MSELoss(), schedule=schedule)
threads = threading.active_count()
outcome = {}

def step():
    try:
        outcome["result"] = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
    except BaseException as error:
        outcome["error"] = error

runner = threading.Thread(target=step, daemon=True)
runner.start()
time.sleep(0.1)  # the step takes about 8 x 2 x 0.02 s: the caller is waiting now
ctypes.pythonapi.PyThreadState_SetAsyncExc(
    ctypes.c_ulong(runner.ident), ctypes.py_object(Interrupt)
)
runner.join(timeout=10)
if runner.is_alive():
    print("the interrupted step did not return within 10 s", flush=True)
    sys.exit(3)
assert isinstance(outcome.get("error"), Interrupt), outcome
time.sleep(0.1)
assert threading.active_count() == threads, (threading.active_count(), threads)
pipe.zero_grad(set_to_none=True)
losses = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
expected = nn.MSELoss()(plain(x), y)
expected.backward()
torch.testing.assert_close(losses.reduced(), expected.detach())
for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
    torch.testing.assert_close(p.grad, q.grad)
print("ok")
"""


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="needs the CPython C API")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_interrupt_while_the_caller_waits_for_the_workers(schedule: str) -> None:
    # An exception raised asynchronously in the thread that called step, while it waits
    # for the workers (a KeyboardInterrupt in the main thread arrives the same way when it
    # lands right after a result came in): the step raises it, stops the workers, and the
    # model is usable.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT, schedule],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"
