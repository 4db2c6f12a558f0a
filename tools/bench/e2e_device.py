r"""The phases of tools/bench/e2e_device_check.sh (one process each, so each runs under its own time limit
and a crash in one leaves the others' figures): the model's prefill and decode on the device, a random-
weights checkpoint, the serving engines, batched-vs-alone identity, and the HTTP server over a unix socket.

    python -m tools.bench.e2e_device PHASE --json FILE [--smoke] [--set key=value ...]

PHASE:
  model       prefill of one long prompt and of the same row as 16 packed documents (TTFT, tokens/s, MFU),
              with --long-prompt N also of one N-token prompt (the 32k check: one slot, linear memory),
              its time split (one KDA mixer, MLA mixer, MoE block, dense FFN and last-token LM head, each
              jitted alone, times their count), then decode steps at B = 1, 8, 32, 64 beside the HBM
              floor and the step's split at B = 64 (each piece a loop of decode steps alone, times its
              count) (random weights, bf16).
  checkpoint  --dir DIR: writes a random-weights checkpoint of the model (run it with JAX_PLATFORMS=cpu:
              it needs no device, and can run beside another phase).
  identity    f32: 32 requests of mixed lengths served together at B=32 against each served alone on the
              same engine: identical greedy tokens.
  server      --checkpoint DIR: `tools.serve --uds` in a child process, the `openai` client streams a
              completion through the unix socket; start-up (compile, loaded from the persistent cache
              after the serving phase) as the server reports it.
The serving comparison (continuous vs static engine, prefix cache on/off) is
`tools/bench/benchmark_serving.py --online --in-process`, run by the shell script.

Figures and formulas (docs/serving.md, "On the lent TPU"):
  - times are wall-clock around calls blocked to completion, median of `--repeats`; a decode step is the
    median over `lax.fori_loop` loops of `--decode-steps` steps in one jit, divided by the steps (device
    time: one dispatch per loop);
  - model FLOPs per token = 2 x the matmul parameters a token uses (embedding lookup excluded, MoE: the
    routed experts a token is sent to, `num_experts_per_tok` of `num_experts`, plus the shared experts)
    + attention: per MLA layer 2 x heads x (qk_nope + qk_rope + v head dims) x the context a token attends
    (half the document on average in prefill), per KDA layer 4 x heads x key dim x value dim (the state
    read and update); MFU = FLOPs/token x tokens/s / PEAK_FLOPS (v5e bf16: 197e12);
  - HBM floor of a decode step = (all weights + every sequence's KDA states and conv windows + the MLA
    latent rows it attends over) read once, at HBM_BYTES_PER_S (v5e: 819e9).
`--smoke`: a tiny model and tiny shapes, on whatever backend jax has (the CPU test runs it that way).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
PEAK_FLOPS = 197e12          # TPU v5e, bf16 MXU peak (tpu_device.md)
HBM_BYTES_PER_S = 819e9      # TPU v5e HBM bandwidth
FULL_CONFIG = "kimi_linear_48b_pattern_0p9b"
SMOKE_CONFIG = "tiny"


# --- model construction ----------------------------------------------------------------------------
def build_config(args, dtype: str):
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.config import load_config
  name = args.config or (SMOKE_CONFIG if args.smoke else FULL_CONFIG)
  return load_config([name, f"dtype={dtype}", f"weight_dtype={dtype}", *args.set])


def build_model(cfg, seed: int = 0):
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from flax import nnx
  from model.nn.kimi_linear import KimiLinearForCausalLM
  return KimiLinearForCausalLM(cfg, rngs=nnx.Rngs(seed))


def split(model):
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  from flax import nnx
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  return graphdef, treedef, leaves


# --- costs -----------------------------------------------------------------------------------------
def parameter_counts(params, cfg) -> dict:
  """Parameters of the tree `params` (a model's nnx.state, or a train state's "params"): all, the
  embedding table, the routed experts, and those one token multiplies by (active_matmul)."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  total = embed = routed = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    name, n = jax.tree_util.keystr(path), int(np.prod(x.shape))
    total += n
    if "embed_tokens" in name:
      embed += n
    elif "['experts']" in name and "shared" not in name:
      routed += n
  active_routed = routed * cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0
  return {"total": total, "embedding": embed, "routed_experts": routed,
          "active_matmul": int(total - embed - routed + active_routed)}


def flops_per_token(cfg, params: dict, context: float) -> float:
  """Model FLOPs of one token attending over `context` earlier tokens (see the module docstring)."""
  n_mla = len(cfg.full_attn_layers)
  n_kda = cfg.num_hidden_layers - n_mla
  mla = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * context
  kda = 4 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
  return 2.0 * params["active_matmul"] + n_mla * mla + n_kda * kda


def tree_bytes(tree) -> int:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def decode_floor_bytes(weights_bytes: int, cache, context: int) -> dict:
  """Bytes a decode step must read: weights, KDA states + conv windows, the MLA rows in use."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.nn import cache as cache_lib
  kda = mla = 0
  for layer in cache.layers:
    if isinstance(layer, cache_lib.KDALayerCache):
      kda += tree_bytes(layer)
    else:
      full = tree_bytes(layer)
      mla += full * min(1.0, (context + 1) / layer.latent.shape[1])
  return {"weights": weights_bytes, "kda_states": kda, "mla_rows": int(mla), "total": int(weights_bytes + kda + mla)}


# --- timing ----------------------------------------------------------------------------------------
def timed(fn, repeats: int) -> tuple[float, list[float]]:
  """Median and all of `repeats` wall-clock seconds of `fn()` (blocked to completion)."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    runs.append(time.perf_counter() - t0)
  return statistics.median(runs), runs


# --- phases ----------------------------------------------------------------------------------------
def phase_model(args) -> dict:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from flax import nnx
  cfg = build_config(args, "bfloat16")
  t_row, n_docs = (128, 4) if args.smoke else (8192, 16)
  batches = (2,) if args.smoke else (1, 8, 32, 64)
  context = 32 if args.smoke else 1024
  steps = args.decode_steps or (4 if args.smoke else 32)
  t0 = time.perf_counter()
  model = build_model(cfg)
  graphdef, treedef, leaves = split(model)
  params = parameter_counts(nnx.state(model), cfg)
  weights = tree_bytes(leaves)
  out = {"config": args.config or (SMOKE_CONFIG if args.smoke else FULL_CONFIG), "overrides": args.set,
         "dtype": cfg.dtype, "attention": cfg.attention, "moe_impl": cfg.moe_impl, "scan_layers": cfg.scan_layers,
         "parameters": params, "weights_bytes": weights, "build_s": round(time.perf_counter() - t0, 2),
         "peak_flops": PEAK_FLOPS, "hbm_bytes_per_s": HBM_BYTES_PER_S, "backend": jax.default_backend(),
         "device": jax.devices()[0].device_kind}
  print(f"model {out['config']}: {params['total'] / 1e9:.3f} B parameters ({weights / 2**30:.2f} GiB), "
        f"{params['active_matmul'] / 1e9:.3f} B active matmul; {out['device']}", flush=True)
  model_of = lambda lv: nnx.merge(graphdef, jax.tree.unflatten(treedef, lv))

  def prefill(lv, ids, seg):   # as a server prefills: the LM head at each document's last token only
    logits, cache = model_of(lv).prefill(ids, seg, num_slots=n_docs, cache_length=t_row, logits_at="last")
    return jnp.argmax(logits, axis=-1), cache

  def decode_loop(lv, tok, cache):
    """`steps` greedy decode steps; the cache comes back with its lengths as they came in (rows
    context..context+steps-1 rewritten each call), so a loop can be timed again on its own output."""
    model = model_of(lv)

    def body(_, carry):
      tok, cache = carry
      logits, cache = model.decode(tok, cache)
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    tok, out = jax.lax.fori_loop(0, steps, body, (tok, cache))
    return tok, type(out)(out.layers, cache.lengths)

  rng = np.random.default_rng(0)

  @functools.partial(jax.jit, static_argnums=0)   # jitted: every leaf its own buffer, as donation needs
  def decode_cache(b):
    """A batch's cache, made only when its loop runs: at the real-width shard every batch's cache at
    once (105 sequences x ~49 MiB) would not fit beside its 9.2 GiB of weights."""
    cache = model.init_cache(b, 1, context + steps + 1)
    return type(cache)(cache.layers, jnp.full((b,), context, jnp.int32))

  decode_tokens = {b: jnp.asarray(rng.integers(3, cfg.vocab_size, (b,)), jnp.int32) for b in batches}
  # Every program traced here, then compiled on threads (XLA's compilation releases the GIL): the
  # phase pays for about the slowest compilation, not the sum. The decode loops donate their cache,
  # as the serving engine's step does: one cache per batch in memory, not an input and an output.
  ids_shape = jax.ShapeDtypeStruct((1, t_row), jnp.int32)
  lowered = {"prefill": jax.jit(prefill).lower(leaves, ids_shape, ids_shape)}
  long_t = args.long_prompt

  def prefill_long(lv, ids):   # one prompt of long_t tokens, one slot
    logits, cache = model_of(lv).prefill(ids, jnp.ones_like(ids), num_slots=1, cache_length=long_t, logits_at="last")
    return jnp.argmax(logits, axis=-1), cache

  if long_t:
    lowered["long prompt"] = jax.jit(prefill_long).lower(leaves, jax.ShapeDtypeStruct((1, long_t), jnp.int32))
  for b in batches:
    lowered[f"decode B={b}"] = jax.jit(decode_loop, donate_argnums=2).lower(
        leaves, decode_tokens[b], jax.eval_shape(decode_cache, b))
  split_pieces = prefill_pieces(model, t_row, n_docs)
  for kind, (fn, state, x, seg, _) in split_pieces.items():
    lowered[f"split {kind}"] = jax.jit(fn).lower(state, x, seg)
  b_split = batches[-1]
  step_pieces = decode_pieces(model, jax.eval_shape(decode_cache, b_split), context, steps)
  for kind, (fn, state, carry, _, _) in step_pieces.items():
    lowered[f"decode split {kind}"] = jax.jit(fn).lower(state, carry)

  def compile_one(item):
    name, low = item
    t = time.perf_counter()
    return name, low.compile(), time.perf_counter() - t

  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.engine.runner import default_compile_threads
  t_compile = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(default_compile_threads(len(lowered))) as pool:
    compiled = {name: (exe, sec) for name, exe, sec in pool.map(compile_one, lowered.items())}
  out["compile"] = {"wall_s": round(time.perf_counter() - t_compile, 2),
                    **{name: round(sec, 2) for name, (_, sec) in compiled.items()}}
  print(f"compiled {len(compiled)} programs in {out['compile']['wall_s']:.1f} s: "
        + ", ".join(f"{n} {sec:.1f} s" for n, (_, sec) in compiled.items()), flush=True)
  args.save_partial(out)
  prefill_c = compiled.pop("prefill")[0]
  ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, t_row)), jnp.int32)
  rows = {"one_prompt": np.ones((1, t_row), np.int32),
          f"{n_docs}x{t_row // n_docs}_packed": np.repeat(np.arange(1, n_docs + 1), t_row // n_docs)[None].astype(np.int32)}
  out["prefill"] = {"row_tokens": t_row,
                    "note": f"one executable for both rows: num_slots={n_docs}, cache_length={t_row}"}
  for name, seg in rows.items():
    seg = jnp.asarray(seg)
    jax.block_until_ready(prefill_c(leaves, ids, seg))   # warm-up
    med, runs = timed(lambda: prefill_c(leaves, ids, seg), args.repeats)
    doc = t_row if name == "one_prompt" else t_row // n_docs
    flops = flops_per_token(cfg, params, doc / 2)
    tps = t_row / med
    out["prefill"][name] = {"ttft_ms": round(med * 1e3, 3), "runs_ms": [round(r * 1e3, 3) for r in runs],
                            "tokens_per_s": round(tps, 1), "flops_per_token": flops,
                            "mfu": round(flops * tps / PEAK_FLOPS, 4)}
    print(f"prefill {name}: TTFT {med * 1e3:.1f} ms, {tps:,.0f} tok/s, MFU {flops * tps / PEAK_FLOPS:.1%}", flush=True)
    args.save_partial(out)
  if long_t:   # the long prompt: linear attention memory end to end (MLA splash, the KDA kernel)
    long_c = compiled.pop("long prompt")[0]
    long_ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, long_t)), jnp.int32)
    jax.block_until_ready(long_c(leaves, long_ids))
    med, runs = timed(lambda: long_c(leaves, long_ids), args.repeats)
    flops = flops_per_token(cfg, params, long_t / 2)
    out["prefill"]["long_prompt"] = {"tokens": long_t, "ttft_ms": round(med * 1e3, 3),
                                     "runs_ms": [round(r * 1e3, 3) for r in runs], "tokens_per_s": round(long_t / med, 1),
                                     "flops_per_token": flops, "mfu": round(flops * long_t / med / PEAK_FLOPS, 4)}
    print(f"prefill one {long_t}-token prompt: TTFT {med * 1e3:.1f} ms, {long_t / med:,.0f} tok/s, "
          f"MFU {flops * long_t / med / PEAK_FLOPS:.1%}", flush=True)
    del long_c
    args.save_partial(out)
  one, packed = out["prefill"]["one_prompt"], out["prefill"][f"{n_docs}x{t_row // n_docs}_packed"]
  out["prefill"]["packed_cost_per_token_vs_one_prompt"] = round(packed["ttft_ms"] / one["ttft_ms"], 3)
  del prefill_c
  args.save_partial(out)

  # The time split of the one-prompt prefill: one layer of each kind as its own program, times the
  # number of such layers (separately jitted, so nothing fuses across layers: their sum need not equal
  # the whole prefill, and the JSON says how far it is).
  time_split = {"method": "one layer of each kind jitted alone at the one-prompt shape, median of --repeats, "
                     "x the layers of that kind", "row_tokens": t_row}
  for kind, (_, state, x, seg, count) in split_pieces.items():
    exe = compiled.pop(f"split {kind}")[0]
    jax.block_until_ready(exe(state, x, seg))
    med, runs = timed(lambda: exe(state, x, seg), args.repeats)
    time_split[kind] = {"ms": round(med * 1e3, 3), "runs_ms": [round(r * 1e3, 3) for r in runs],
                        "layers": count, "total_ms": round(med * 1e3 * count, 2)}
  time_split["sum_ms"] = round(sum(v["total_ms"] for v in time_split.values() if isinstance(v, dict)), 2)
  time_split["whole_prefill_ms"] = one["ttft_ms"]
  out["prefill"]["split"] = time_split
  print("prefill split: " + ", ".join(f"{k} {v['layers']} x {v['ms']:.2f} = {v['total_ms']:.1f} ms"
                                      for k, v in time_split.items() if isinstance(v, dict))
        + f"; sum {time_split['sum_ms']:.1f} ms of {one['ttft_ms']:.1f}", flush=True)

  out["decode"] = {"context_tokens": context, "steps_per_loop": steps}
  for b in batches:
    if time.perf_counter() - t0 > args.stop_after_s:
      out["decode"][f"B={b}"] = {"skipped": f"phase time limit {args.stop_after_s:.0f} s reached"}
      continue
    tok, live = decode_tokens[b], {"cache": decode_cache(b)}
    floor = decode_floor_bytes(weights, live["cache"], context)
    loop_c = compiled.pop(f"decode B={b}")[0]

    def run_loop(loop_c=loop_c, tok=tok, live=live):   # the donated cache is replaced by the loop's own
      out, live["cache"] = loop_c(leaves, tok, live["cache"])
      return out

    jax.block_until_ready(run_loop())
    med, runs = timed(run_loop, args.repeats)
    step_ms = med / steps * 1e3
    floor_ms = floor["total"] / HBM_BYTES_PER_S * 1e3
    out["decode"][f"B={b}"] = {"step_ms": round(step_ms, 4), "hbm_floor_ms": round(floor_ms, 4),
                               "x_floor": round(step_ms / floor_ms, 3), "floor_bytes": floor,
                               "tokens_per_s": round(b / step_ms * 1e3, 1),
                               "loop_runs_ms": [round(r * 1e3, 3) for r in runs]}
    print(f"decode B={b}: {step_ms:.2f} ms/step, HBM floor {floor_ms:.2f} ms ({step_ms / floor_ms:.2f}x)", flush=True)
    args.save_partial(out)
    del loop_c, live, run_loop   # run_loop's defaults hold the cache too: at the real-width shard B=64's
                                 # 3.2 GiB left the decode split no room

  # The decode step's split at the largest batch: one piece of each kind as its own loop of `steps`
  # steps (output fed back), times the number of such pieces in the model.
  step_split = {"method": f"one piece of each kind jitted alone as a loop of {steps} steps at B={b_split} "
                     f"(context {context}), median of --repeats, per step x the pieces of that kind; "
                     "the embedding, the layer norms, the residual adds and sampling are not in any piece",
                "batch": b_split}
  split_cache = decode_cache(b_split)
  for kind, (_, state, carry, count, layer) in step_pieces.items():
    if time.perf_counter() - t0 > args.stop_after_s:
      step_split[kind] = {"skipped": f"phase time limit {args.stop_after_s:.0f} s reached"}
      continue
    exe = compiled.pop(f"decode split {kind}")[0]
    if layer is not None:   # a mixer: its layer of a real cache in place of the shapes it was lowered with
      carry = (carry[0], split_cache.layers[layer])
    jax.block_until_ready(exe(state, carry))
    med, runs = timed(lambda: exe(state, carry), args.repeats)
    step_split[kind] = {"ms": round(med / steps * 1e3, 4), "loop_runs_ms": [round(r * 1e3, 3) for r in runs],
                        "layers": count, "total_ms": round(med / steps * 1e3 * count, 3)}
  done = [v for v in step_split.values() if isinstance(v, dict) and "ms" in v]
  step_split["sum_ms"] = round(sum(v["total_ms"] for v in done), 3)
  step_split["whole_step_ms"] = out["decode"].get(f"B={b_split}", {}).get("step_ms")
  out["decode"]["split"] = step_split
  print(f"decode split B={b_split}: " + ", ".join(f"{k} {v['layers']} x {v['ms']:.3f} = {v['total_ms']:.2f} ms"
                                                 for k, v in step_split.items() if isinstance(v, dict) and "ms" in v)
        + f"; sum {step_split['sum_ms']:.2f} ms of {step_split['whole_step_ms']}", flush=True)
  args.save_partial(out)
  return out


def decode_pieces(model, cache, context: int, steps: int) -> dict:
  """`{kind: (fn(state, carry), state, carry, count, layer)}` for the decode step's time split: the KDA and
  MLA mixers' decode (each reading and writing its layer's cache, every sequence at `context`), the
  MoE block, the dense FFN and the LM head, each on a random `[S, hidden]` input in the model's
  dtype, S = `cache`'s sequences; `fn` runs `steps` steps in a `lax.fori_loop`, each step's output
  fed back as the next one's input (and the mixers' new cache as their next cache), so the figure is
  device time, not dispatch. `count` is how many times a decode step runs that piece. `cache` may be
  abstract (`jax.eval_shape`, to lower against): a mixer's carry is then `(x, shapes)`, and `layer`,
  its index in `cache.layers` (None for the other pieces), says which real layer cache runs it."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from flax import nnx
  layers, types = model.model.layers, model.args.layer_types
  s = cache.num_sequences
  x = jax.random.normal(jax.random.key(2), (s, model.args.hidden_size)).astype(model.args.dtype)
  lengths = jnp.full((s,), context, jnp.int32)

  def mixer_step(m, carry):
    h, c = carry
    y, c = m.decode(h, c, lengths)
    return y.astype(h.dtype), c

  ffn_step = lambda m, carry: (m(carry[0]).astype(carry[0].dtype), None)

  def head_step(m, carry):   # the logits feed back through their row maximum: every column is needed
    h = carry[0]
    logits = m.lm_head(m.model.norm(h))
    return (h + jnp.max(logits, axis=-1, keepdims=True).astype(h.dtype)), None

  chosen = {}
  for kind in ("kda", "mla"):
    if kind in types:
      i = types.index(kind)
      chosen[kind] = (layers[i].self_attn, mixer_step, (x, cache.layers[i]), types.count(kind), i)
  moe = [layer for layer in layers if layer.is_moe]
  dense = [layer for layer in layers if not layer.is_moe]
  if moe:
    chosen["moe"] = (moe[0].block_sparse_moe, ffn_step, (x, None), len(moe), None)
  if dense:
    chosen["dense_ffn"] = (dense[0].mlp, ffn_step, (x, None), len(dense), None)
  chosen["lm_head"] = (model, head_step, (x, None), 1, None)
  out = {}
  for kind, (module, step, carry, count, layer) in chosen.items():
    gd, state = nnx.split(module)

    def fn(st, carry, gd=gd, step=step):
      m = nnx.merge(gd, st)
      return jax.lax.fori_loop(0, steps, lambda _, c: step(m, c), carry)

    out[kind] = (fn, state, carry, count, layer)
  return out


def prefill_pieces(model, t_row: int, n_docs: int) -> dict:
  """`{kind: (fn(state, x, seg), state, x, seg, count)}` for the prefill time split: the KDA and MLA
  mixers (prefill mode, writing their caches), the MoE block, the dense FFN and the last-token LM head,
  each on a random `[1, t_row, hidden]` row in the model's dtype, one document of `t_row` tokens;
  `count` is how many times the model runs that piece."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  import jax
  import jax.numpy as jnp
  from flax import nnx
  layers, types = model.model.layers, model.args.layer_types
  x = jax.random.normal(jax.random.key(1), (1, t_row, model.args.hidden_size)).astype(model.args.dtype)
  seg = jnp.ones((1, t_row), jnp.int32)

  def mixer(m, h, s):
    return m(h, segment_ids=s, mode="prefill", num_slots=n_docs, return_cache=True, cache_length=t_row)

  chosen = {kind: (layers[types.index(kind)].self_attn, mixer, types.count(kind))
            for kind in ("kda", "mla") if kind in types}
  moe = [layer for layer in layers if layer.is_moe]
  dense = [layer for layer in layers if not layer.is_moe]
  if moe:
    chosen["moe"] = (moe[0].block_sparse_moe, lambda m, h, s: m(h), len(moe))
  if dense:
    chosen["dense_ffn"] = (dense[0].mlp, lambda m, h, s: m(h), len(dense))
  chosen["lm_head_last"] = (model, lambda m, h, s: m.last_logits(h, s, n_docs), 1)
  out = {}
  for kind, (module, call, count) in chosen.items():
    gd, state = nnx.split(module)
    out[kind] = ((lambda gd, call: lambda st, h, s: call(nnx.merge(gd, st), h, s))(gd, call), state, x, seg, count)
  return out


def phase_checkpoint(args) -> dict:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.checkpoint.format import save_parameters
  cfg = build_config(args, "bfloat16")
  t0 = time.perf_counter()
  model = build_model(cfg)
  path = save_parameters(args.dir, model, cfg, overwrite=True)
  return {"path": str(path), "config": cfg.model_name, "seconds": round(time.perf_counter() - t0, 1)}


def phase_identity(args) -> dict:
  """f32 greedy: each request's tokens served in a batch of 32 equal its tokens served alone.

  At full float32 matmul precision (the `matmul_precision=highest` job key's context,
  `model.config.matmul_precision`, around the engine's tracing and serving: process-wide, so the
  threads that trace see it too; `jax.default_matmul_precision` alone is per thread): XLA's
  default on a TPU runs a float32 dot as one bfloat16 pass, and a
  random-weights model turns that rounding into different greedy tokens between any two programs
  (on the chip at 51dfd8f 30 of 32 requests differed; on the CPU, rounding the dots' inputs to
  bfloat16 moved the 0.9B model's logits by ~2 for a 1e-7 change of its weights alone)."""
  from model.config import matmul_precision  # noqa: PLC0415
  with matmul_precision("highest"):
    return {**_identity(args), "matmul_precision": "highest"}


def _identity(args) -> dict:
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from model.engine.api import Request
  from model.engine.config import EngineConfig
  from model.engine.continuous import ContinuousEngine
  from model.engine.warmup import compile_engine
  cfg = build_config(args, "float32")
  n, new = (8, 4) if args.smoke else (32, 16)
  longest = 48 if args.smoke else 256
  model = build_model(cfg)
  config = EngineConfig(max_num_seqs=n, max_model_len=longest + new + 1,
                        max_num_batched_tokens=16 if args.smoke else 256)
  engine = ContinuousEngine(model, config)
  report = compile_engine(engine)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, cfg.vocab_size, int(rng.integers(8, longest + 1))).tolist() for _ in range(n)]

  def serve(batch):
    """{request id: {"tokens", "logprobs", "top2" (the two largest logits at each token),
    "cached_tokens"}} of the requests in `batch`, served together."""
    got = {}

    def on_event(e):
      if e.token_id is None:
        return
      r = got.setdefault(e.request_id, {"tokens": [], "logprobs": [], "top2": [], "cached_tokens": 0})
      r["tokens"].append(e.token_id)
      r["logprobs"].append(e.logprob)
      r["top2"].append(engine.last_top2.get(e.request_id))
      r["cached_tokens"] = e.cached_tokens

    for i in batch:
      engine.add_request(Request(f"q{i}", tuple(prompts[i]), new))
    while engine.has_unfinished():
      engine.step(on_event)
    return got

  t0 = time.perf_counter()
  together = serve(range(n))
  t_batch = time.perf_counter() - t0
  alone = {}
  for i in range(n):
    alone.update(serve([i]))
  differ = [i for i in range(n) if together[f"q{i}"]["tokens"] != alone[f"q{i}"]["tokens"]]
  # How far apart the two runs' numbers are where their tokens still agree (the first token's log-prob
  # always): a difference at the noise of float32 with a top-2 gap as small says precision chose the
  # other token; a large one says the two paths compute something else.
  lp_diff, gaps = [], []
  for i in range(n):
    a, b = together[f"q{i}"], alone[f"q{i}"]
    agree = next((k for k in range(len(a["tokens"])) if a["tokens"][k] != b["tokens"][k]), len(a["tokens"]))
    lp_diff.append(max(abs(a["logprobs"][k] - b["logprobs"][k]) for k in range(max(1, agree))))
    if b["top2"][0] is not None:
      gaps.append(b["top2"][0][0] - b["top2"][0][1])
  first = None
  if differ:
    a, b = together[f"q{differ[0]}"], alone[f"q{differ[0]}"]
    k = next(k for k in range(len(a["tokens"])) if a["tokens"][k] != b["tokens"][k])
    first = {"request": differ[0], "position": k, "batched": a["tokens"], "alone": b["tokens"],
             "batched_logprob": a["logprobs"][k], "alone_logprob": b["logprobs"][k],
             "batched_top2": a["top2"][k], "alone_top2": b["top2"][k]}
  return {"dtype": cfg.dtype, "requests": n, "new_tokens": new, "max_num_seqs": n,
          "prompt_lengths": [len(p) for p in prompts], "identical": not differ, "differing_requests": differ,
          "first_difference": first,
          "first_token_logprob_diff_max": max(lp_diff),
          "first_token_logprob_diff_median": float(np.median(lp_diff)),
          "first_token_top2_gap_median": float(np.median(gaps)) if gaps else None,
          "alone_cached_tokens": [alone[f"q{i}"]["cached_tokens"] for i in range(n)],
          "batched_s": round(t_batch, 2), "compile": report.as_dict()}


def phase_server(args) -> dict:
  """`tools.serve --uds` in a child process; the openai client streams through the socket."""
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from tools.bench import uds_client
  sock = f"/tmp/kda-e2e-{os.getpid()}.sock"
  log_path = pathlib.Path(args.json).with_suffix(".serve.log")
  keys = list(args.serve_key) or ["max_num_seqs=4", "max_model_len=256", "max_num_batched_tokens=64"]
  argv = [sys.executable, "-m", "tools.serve", f"load_parameters_path={args.checkpoint}", "--uds", sock, *keys]
  print("$ " + " ".join(argv), flush=True)
  t0 = time.perf_counter()
  with open(log_path, "w+") as log:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
      line = ""
      while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
          log.seek(0)
          raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
      ready_s = time.perf_counter() - t0
      client = uds_client.openai_client(sock)
      served = client.models.list().data[0].id
      vocab = json.loads((pathlib.Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
      ids = np.random.default_rng(2).integers(3, min(200, vocab), 48).tolist()
      sent = time.perf_counter()
      first = None
      streamed, chunks = [], 0
      stream = client.completions.create(model=served, prompt=ids, max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
      for chunk in stream:
        if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
          first = first or time.perf_counter()
          streamed += chunk.choices[0].model_extra["token_ids"]
          chunks += 1
      whole = client.completions.create(model=served, prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
      same = whole.choices[0].model_extra["token_ids"] == streamed
      proc.terminate()
      rc = proc.wait(timeout=60)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      proc.stdout.close()
    log.seek(0)
    text = log.read()
  print("--- the server's log:\n" + text[-6000:], flush=True)
  # imported in the phase that needs it: a missing package fails that phase alone, by name
  from tools.bench.serving_load import startup_figures
  return {"uds": sock, "listening_line": line.strip(), "listening_after_s": round(ready_s, 2),
          **startup_figures(text), "streamed_tokens": len(streamed), "stream_chunks": chunks,
          "ttft_ms": round((first - sent) * 1e3, 2) if first else None, "streamed_equals_whole": same,
          "exit_status": rc, "socket_removed": not os.path.exists(sock), "serve_keys": keys}


PHASES = {"model": phase_model, "checkpoint": phase_checkpoint, "identity": phase_identity, "server": phase_server}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tools.bench.e2e_device", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  p.add_argument("phase", choices=sorted(PHASES))
  p.add_argument("--json", required=True, help="where the phase's figures are written")
  p.add_argument("--smoke", action="store_true", help="a tiny model and shapes (the CPU test)")
  p.add_argument("--config", default="", help=f"model config (default {FULL_CONFIG}; --smoke: {SMOKE_CONFIG})")
  p.add_argument("--set", action="append", default=[], help="key=value config override (repeatable)")
  p.add_argument("--repeats", type=int, default=5, help="timed runs of each figure, >= 1 (default: %(default)s)")
  p.add_argument("--decode-steps", type=int, default=0,
                 help="model: decode steps in each timed loop (default 0: 32, --smoke: 4)")
  p.add_argument("--long-prompt", type=int, default=0,
                 help="model: also prefill one prompt of this many tokens (TTFT, MFU) (default 0: none)")
  p.add_argument("--stop-after-s", type=float, default=float("inf"),
                 help="model: skip the decode batches still to run after this many seconds")
  p.add_argument("--dir", default="", help="checkpoint: where to write it")
  p.add_argument("--checkpoint", default="", help="server: the checkpoint to serve")
  p.add_argument("--serve-key", action="append", default=[], help="server: a tools.serve key=value (repeatable)")
  p.add_argument("--compilation-cache-dir", default="", help="jax's persistent cache ('' = the default; none = off)")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be >= 1, got {args.repeats}")
  for name in ("decode_steps", "long_prompt"):
    if getattr(args, name) < 0:
      p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
  if args.phase == "checkpoint" and not args.dir:
    p.error("checkpoint needs --dir")
  if args.phase == "server" and not args.checkpoint:
    p.error("server needs --checkpoint")
  if args.phase != "server":   # the server child enables its own
    # imported in the phase that needs it: a missing package fails that phase alone, by name
    from model.engine import compilation_cache
    print(compilation_cache.enable(args.compilation_cache_dir), flush=True)
  t0 = time.perf_counter()
  out_path = pathlib.Path(args.json)

  def write(result: dict) -> None:  # atomic: a phase killed at its time limit leaves the last whole file
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, out_path)

  # what a phase has measured so far, rewritten after each figure: a phase stopped at its time limit
  # still reports the figures it reached ("partial": true)
  args.save_partial = lambda out: write({"phase": args.phase, "smoke": args.smoke, "partial": True, **out,
                                         "phase_s": round(time.perf_counter() - t0, 2)})
  result = {"phase": args.phase, "smoke": args.smoke, **PHASES[args.phase](args)}
  result["phase_s"] = round(time.perf_counter() - t0, 2)
  write(result)
  print(f"wrote {args.json}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
