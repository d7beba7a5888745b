"""Leaving a gloo process group without the DDP teardown deadlock.

A process that trained a ``DistributedDataParallel`` model on gloo (every CPU run of
``accelerate launch`` with two processes) can hang for ever once its work is done. torch's
``Reducer`` (DDP's gradient bucketer) holds a C++ reference to the process group; once
``destroy_process_group()`` has dropped Python's, the Reducer is the last holder, and freeing the
DDP model (at the end of ``main()``, or at interpreter exit) destroys ``ProcessGroupGloo`` from the
Reducer's binding *with the GIL held*. That destructor joins gloo's worker threads, and a worker
that is still freeing the last all-reduce's tensors waits for the GIL to drop their Python objects:
each waits for the other (torch's pybind destructors that block, pytorch/pytorch#56297). It is a
race: a loop of DDP set-ups and teardowns on two gloo ranks hangs within its first rounds
(``tests/distributed/test_ddp_teardown.py``).

Freeing the Reducer (and DDP's ``Logger``, which holds it too) while the process group is still
registered makes it an ordinary reference drop; the group is then destroyed from its own binding,
which releases the GIL first. :meth:`amp_trainer.AmpAccelerator.end_training` does this for every
model it wrapped; a loop on a stock ``Accelerator`` or ``Trainer`` calls
:func:`release_ddp_reducers` just before ``end_training()``.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Attributes of torch's DistributedDataParallel that hold the C++ Reducer (and through it the
# process group): the Reducer itself and the Logger built on it.
_REDUCER_HOLDERS = ("logger", "reducer")


def release_ddp_reducers(*modules: torch.nn.Module | None) -> int:
    """Free the gradient Reducer of each ``DistributedDataParallel`` in ``modules``.

    Call it after the last backward and before ``destroy_process_group()`` /
    ``accelerator.end_training()``. Afterwards a wrapper cannot run a forward with gradients
    (its process group is about to go anyway); ``accelerator.unwrap_model(model)`` and the
    wrapped module itself are untouched, so saving and evaluating the unwrapped model still work.
    Anything that is not a DDP wrapper (``None``, a plain or FSDP2-sharded module, a wrapper
    already released) is left alone.

    Returns:
        How many wrappers had a Reducer freed.
    """
    from torch.nn.parallel import DistributedDataParallel

    released = 0
    for module in modules:
        if not isinstance(module, DistributedDataParallel):
            continue
        held = [name for name in _REDUCER_HOLDERS if name in module.__dict__]
        for name in held:
            delattr(module, name)
        if "reducer" in held:
            released += 1
    if released:
        logger.debug("Freed %d DDP reducer(s) before leaving the process group.", released)
    return released
