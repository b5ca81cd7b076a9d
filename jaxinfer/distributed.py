"""Several processes (hosts) running one model with JAX's multi-controller runtime.

Every process loads the model onto the same global mesh and builds the same ModelRunner. Only the lead process
(process 0) runs the scheduler and the HTTP server; before each step it broadcasts the step's host inputs, and
the followers run the identical compiled step, so XLA's collectives line up across hosts.

Launch (one command per host; on TPU pods and SLURM, jax finds the coordinator and ranks itself):
    python serve.py --model M --tensor-parallel-size T --coordinator-address HOST0:PORT --num-processes N --process-id I
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer.sampling import SamplingTensors
from jaxinfer.step import StepInputs

_STEP, _STOP = 1, 2


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:  # fmt: skip
    """jax.distributed.initialize from flags; with none given, jax reads its cluster environment."""
    # CPU processes need a collectives backend to talk to each other (tests, laptops); GPUs and TPUs use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def is_lead() -> bool:
    return jax.process_index() == 0


def agree_on(value: int) -> int:
    """The lead's value of an integer, on every process."""
    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def _to_wire(tree):
    # Bools do not survive the broadcast's sum; send them as bytes.
    return jax.tree.map(
        lambda x: np.asarray(x).astype(np.uint8) if np.asarray(x).dtype == bool else np.asarray(x), tree
    )


def _from_wire(tree, like):
    return jax.tree.map(lambda x, ref: np.asarray(x).astype(np.asarray(ref).dtype), tree, like)


class Followers:
    """The lead's side: announces each step, then sends its inputs."""

    def __init__(self, runner):
        self.runner = runner

    def send_step(self, inp: StepInputs, st: SamplingTensors, decode_only: bool, advanced: bool, prompt_lp: bool):
        t, s = inp.num_tokens, inp.max_seqs
        header = np.array([_STEP, decode_only, t, s, advanced, prompt_lp], np.int32)
        multihost_utils.broadcast_one_to_all(header)
        sent = multihost_utils.broadcast_one_to_all(_to_wire((inp, st)))
        return _from_wire(sent, (inp, st))

    def stop(self) -> None:
        multihost_utils.broadcast_one_to_all(np.array([_STOP, 0, 0, 0, 0, 0], np.int32))


def attach_followers(runner) -> None:
    """Makes this process's runner the lead of a multi-process mesh."""
    if jax.process_count() > 1 and is_lead():
        runner.followers = Followers(runner)


def follow(runner) -> None:
    """A follower's whole life: run every step the lead announces, until it says stop."""
    while True:
        header = multihost_utils.broadcast_one_to_all(np.zeros(6, np.int32))
        cmd, decode_only, t, s, advanced, prompt_lp = (int(x) for x in header)
        if cmd == _STOP:
            return
        like = runner.padding_inputs(bool(advanced), t, s)
        inp, st = _from_wire(multihost_utils.broadcast_one_to_all(_to_wire(like)), like)
        runner.launch(inp, st, bool(decode_only), bool(advanced), bool(prompt_lp))
