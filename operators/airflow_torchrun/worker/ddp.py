"""Exact resumes with DistributedDataParallel at any world size: prime its gradient buckets first.

**Why a resume is not bit-identical without it** (measured at world size 4 through the
operator by ``tests/test_goodput_runs.py``: primed, the resume audit says ``exact``; unprimed, it
does not; the README's "Resume audit"):
DDP all-reduces gradients in flat *buckets*. A freshly built DDP lays its buckets out in the order
of ``model.parameters()``; after its first backward pass it rebuilds them once, in the order the
gradients became ready (``Reducer::rebuild_buckets``, unless ``find_unused_parameters=True``). The
all-reduce (gloo's ring, NCCL's) sums each element in an order that depends on where the element
sits in the bucket, so after the rebuild every gradient is summed in another order. With two ranks
that cannot change a bit (``a + b == b + a``); with three or more it can (``(a + b) + c`` is not
``(a + c) + b`` in floating point). An uninterrupted run computes step ``S + 1`` in the rebuilt
layout; a run resumed from step ``S`` builds a new DDP and computes step ``S + 1`` in the initial
one: its weights differ in the last bits from there on.

:func:`prime_ddp_buckets` runs one forward and backward pass of an example batch through a freshly
built DDP, so its buckets are rebuilt before the first real step (every launch, fresh or resumed,
then computes every step in the same layout), and leaves no trace: the gradients are cleared, the
module's buffers (BatchNorm statistics) and the RNG states are put back, the optimizer is not
touched. Call it on every rank, right after building DDP and before the first step::

    from airflow_torchrun.worker import prime_ddp_buckets

    ddp = prime_ddp_buckets(DistributedDataParallel(model), example_batch)

It costs one forward and backward pass (and one all-reduce) per launch. The other way to the same
end, ``DistributedDataParallel(model, find_unused_parameters=True)``, never rebuilds the buckets, at
the price of a walk over the autograd graph every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _scalar(output: Any) -> torch.Tensor:
    """A scalar that depends on every floating-point tensor in ``output`` (a tensor, or nested
    tuples, lists and dicts of them)."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.requires_grad:
                tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)

    collect(output)
    if not tensors:
        raise ValueError(
            "prime_ddp_buckets: the model's output on the example holds no tensor that needs a gradient; "
            "pass loss_fn=... that turns the output into the loss"
        )
    total = tensors[0].float().sum()
    for tensor in tensors[1:]:
        total = total + tensor.float().sum()
    return total


def prime_ddp_buckets(
    ddp: torch.nn.parallel.DistributedDataParallel,
    *example_args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **example_kwargs: Any,
) -> torch.nn.parallel.DistributedDataParallel:
    """Rebuild ``ddp``'s gradient buckets now, with one pass of an example batch; returns ``ddp``.

    :param ddp: a ``DistributedDataParallel`` that has not taken a step yet (on every rank).
    :param example_args: what ``ddp(...)`` takes (a slice of a real batch does; its values do not
        matter, only which parameters get gradients and in which order).
    :param loss_fn: turns the output into the scalar to differentiate; default the sum of every
        floating-point tensor in the output.

    The parameters' gradients are None afterwards, the module's buffers and the RNG states (CPU and
    CUDA) are those from before, so the training that follows is the one it would have been, with
    every step's gradients all-reduced in the rebuilt bucket layout.
    """
    module = ddp.module
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        output = ddp(*example_args, **example_kwargs)
        loss = loss_fn(output) if loss_fn is not None else _scalar(output)
        loss.backward()
    for parameter in module.parameters():
        parameter.grad = None
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    # DDP rebuilds the buckets at the start of the next forward pass (its _pre_forward), in the
    # order this backward pass recorded: before the first real step's gradients exist.
    return ddp
