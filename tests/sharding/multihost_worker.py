"""One process of the two-process test: `python multihost_worker.py PORT PROCESS_ID OUT_JSON`.

Both processes build the same tiny model on a tensor-parallel mesh spanning them; process 0 schedules and writes
the greedy tokens it generated; process 1 follows.
"""

import json
import sys

from jaxinfer import distributed

port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax  # noqa: E402

from jaxinfer.engine.config import CacheConfig  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402
from jaxinfer.sharding import make_mesh  # noqa: E402
from jaxinfer.weights.layout import build_on_mesh  # noqa: E402
from tests.sharding.multihost_common import CC, PROMPTS, SAMPLING, host_getter, tiny_config  # noqa: E402

cfg = tiny_config()
mesh = make_mesh(2, 1, devices=jax.devices())
c, params = build_on_mesh(cfg, host_getter(cfg), "float32", mesh)
engine = Engine(c, params, CacheConfig(**CC), mesh=mesh)
if distributed.is_lead():
    distributed.attach_followers(engine.runner)
    tokens = [r[0].output_token_ids for r in engine.generate(PROMPTS, SAMPLING)]
    engine.runner.followers.stop()
    with open(out, "w") as f:
        json.dump(tokens, f)
else:
    distributed.follow(engine.runner)
