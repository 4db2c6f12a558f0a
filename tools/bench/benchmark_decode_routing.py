r"""Decode routing of the continuous engine: a decode-only step through the mixed step (one-token
segments, `kda_inference` via `KimiLinearForCausalLM.prefill`) against `KimiLinearForCausalLM.decode`
(`kda_decode_step`, the absorbed MLA form), same slots, same pool state, same sampling (greedy).

    .venv/bin/python tools/bench/benchmark_decode_routing.py [--checkpoint kda_plugin/assets/demo] \
        [--slots 8] [--max-model-len 640] [--context 200] [--runs 30] [--json FILE]

Every slot first prefills a `--context`-token prompt through the engine (so the MLA latents and KDA
states are real), then each path runs `--runs` timed steps after 3 warm-up steps, on a copy of the
pool (both paths donate their cache). Figures: median and best milliseconds per step (host wall
clock, each step blocked on), and decode tokens/s = slots / median step time. Compilation is
excluded. The machine may be shared: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.engine.api import Request
from model.engine.continuous import ContinuousEngine
from model.engine.config import EngineConfig
from model.loading import load_model


def _time(fn, runs):
  for _ in range(3):
    fn()
  out = []
  for _ in range(runs):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", default="kda_plugin/assets/demo")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--max-model-len", type=int, default=640)
  ap.add_argument("--context", type=int, default=200)
  ap.add_argument("--runs", type=int, default=30)
  ap.add_argument("--json", default="")
  a = ap.parse_args(argv)
  if not 1 <= a.context < a.max_model_len - a.runs - 8:
    print(f"error: --context must be in [1, {a.max_model_len - a.runs - 8}), got {a.context}", file=sys.stderr)
    return 2
  model, _ = load_model(a.checkpoint)
  engine = ContinuousEngine(model, EngineConfig(max_num_seqs=a.slots, max_model_len=a.max_model_len,
                                                max_num_batched_tokens=max(16, a.slots), decode_path="mixed"))
  rng = np.random.default_rng(0)
  for s in range(a.slots):
    engine.add_request(Request(f"c{s}", tuple(int(t) for t in rng.integers(4, 1000, a.context)), a.max_model_len - a.context))
  while any(seq.prefilling or not seq.output_ids for seq in engine._running) or engine.stats().num_waiting:
    engine.step(lambda e: None)
  s_count = a.slots
  last = np.array([seq.output_ids[-1] for seq in sorted(engine._running, key=lambda q: q.slot)], np.int32)
  copy = lambda c: jax.tree.map(lambda x: jnp.array(x, copy=True), c)

  # (a) the mixed step: one-token segments labelled slot + 1, padded to the smallest bucket.
  runner = engine.runner
  bucket = runner.buckets[0]
  fn = runner.compiled_step(bucket)
  ids = np.zeros((1, bucket), np.int32)
  seg = np.zeros((1, bucket), np.int32)
  ids[0, :s_count], seg[0, :s_count] = last, np.arange(1, s_count + 1)
  samp = (np.zeros(s_count, bool), np.ones(s_count, bool), np.ones(s_count, np.float32), np.zeros(s_count, np.int32),
          np.ones(s_count, np.float32), np.zeros(s_count, np.uint32), np.zeros(s_count, np.int32),
          np.int32(runner.vocab_limit))
  state = {"pool": copy(runner.pool.cache)}

  def mixed():
    tok, _, _, state["pool"] = fn(runner.leaves, state["pool"], ids, seg, *samp)
    jax.block_until_ready(tok)

  # (b) model.decode over the S sequences (kda_decode_step), greedy, cache donated.
  graphdef, st = nnx.split(model)
  leaves, treedef = jax.tree.flatten(st)

  def dec(leaves, tok, cache):
    logits, cache = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)).decode(tok, cache)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache

  dec_c = jax.jit(dec, donate_argnums=(2,)).lower(leaves, jnp.asarray(last), state["pool"]).compile()
  state["cache"] = copy(runner.pool.cache)
  tok0 = jnp.asarray(last)

  def decode():
    tok, state["cache"] = dec_c(leaves, tok0, state["cache"])
    jax.block_until_ready(tok)

  res = {}
  for name, f in (("mixed_step_one_token_segments", mixed), ("model_decode", decode)):
    t = _time(f, a.runs)
    med = statistics.median(t)
    res[name] = dict(median_ms=1e3 * med, best_ms=1e3 * min(t), decode_tokens_per_s=s_count / med)
  res.update(slots=s_count, bucket=bucket, context=a.context, runs=a.runs, loadavg=os.getloadavg()[0],
             ratio_mixed_over_decode=res["mixed_step_one_token_segments"]["median_ms"] / res["model_decode"]["median_ms"])
  print(json.dumps(res, indent=1))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
