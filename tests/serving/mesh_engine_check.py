"""The continuous engine on 8 simulated CPU devices (data 4 x tensor 2) against one device.

Run by tests/serving/test_continuous_mesh.py as `python -m tests.serving.mesh_engine_check` with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`; prints one JSON object as
its last stdout line: each request's tokens and log-probs on the mesh and on one device, the
mesh, and the shardings of the slot pool's leaves (so the equality is not vacuous).
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np

from model import loading, partitioning
from model.engine.api import Request
from model.engine.config import EngineConfig
from model.engine.continuous import ContinuousEngine

DEMO = pathlib.Path(__file__).resolve().parents[2] / "kda_plugin" / "assets" / "demo"
MESH_KEYS = ["ici_data_parallelism=4", "ici_tensor_parallelism=2"]


def requests():
  rng = np.random.default_rng(0)
  shared = tuple(int(t) for t in rng.integers(4, 1000, 64))
  prompts = [shared + tuple(int(t) for t in rng.integers(4, 1000, 9))]
  prompts += [tuple(int(t) for t in rng.integers(4, 1000, n)) for n in (3, 40, 17, 90)]
  prompts += [shared + tuple(int(t) for t in rng.integers(4, 1000, 21))]   # a prefix-cache hit on the mesh
  return [Request(f"r{i}", p, 6) for i, p in enumerate(prompts)]


def serve(engine):
  out = {}
  reqs = requests()
  engine.add_request(reqs[0])
  while engine.has_unfinished():   # the first request alone first, so its prefix is saved before r5 arrives
    engine.step(lambda e: out.setdefault(e.request_id, []).append(e))
  for r in reqs[1:]:
    engine.add_request(r)
  while engine.has_unfinished():
    engine.step(lambda e: out.setdefault(e.request_id, []).append(e))
  return ({k: [e.token_id for e in v] for k, v in out.items()}, {k: [e.logprob for e in v] for k, v in out.items()},
          {k: v[-1].cached_tokens for k, v in out.items()})


def main():
  sizes = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=16)   # one bucket (+ its one-prompt variant, the decode-only step)
  loaded = loading.load(DEMO, MESH_KEYS)
  assert loaded.mesh is not None and loaded.mesh.size == 8, loaded.mesh
  mesh_engine = ContinuousEngine(loaded.model, EngineConfig(prefix_cache_bytes=1 << 24, **sizes), mesh=loaded.mesh,
                                 rules=loaded.config)
  mesh_tokens, mesh_lp, cached = serve(mesh_engine)
  pool = mesh_engine.pool.cache
  specs = {"kda_state": str(pool.layers[0].state.sharding.spec), "mla_latent": str(pool.layers[2].latent.sharding.spec),
           "lengths": str(pool.lengths.sharding.spec)}
  one = ContinuousEngine(loading.load(DEMO, mesh=None).model, EngineConfig(**sizes))
  one_tokens, one_lp, _ = serve(one)
  diff = max(abs(a - b) for k in one_lp for a, b in zip(mesh_lp[k], one_lp[k]))
  print(json.dumps(dict(mesh=partitioning.describe_mesh(loaded.mesh), devices=jax.device_count(), specs=specs,
                        mesh_tokens=mesh_tokens, one_tokens=one_tokens, max_logprob_diff=diff, cached=cached,
                        compilations=mesh_engine.stats().num_compilations)))


if __name__ == "__main__":
  main()
