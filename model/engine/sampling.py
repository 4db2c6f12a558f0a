"""The one sampler: next-token selection from logits `[B, V]` with per-row parameters (JAX).

Strategies, "temperature, then filter" (HF `generate` warpers, vLLM): "greedy" (argmax, lowest id
on ties), "weighted" (softmax(logits / temperature)), "topk" (exactly the k largest, ties to the
lower id) and "nucleus" (the shortest prefix of the sorted distribution whose mass reaches top_p;
the most likely token always stays). `sample_rows` implements all four; `sample_tokens` /
`make_sampler`, the Generator and the continuous engine's step (`sample_step`) all go through it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

STRATEGIES = ("greedy", "weighted", "topk", "nucleus")


def check_sampling_args(strategy: str, temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None, vocab_size: int | None = None,
                        names: dict[str, str] | None = None) -> None:
  """Validates a sampling configuration; `names` maps the argument names to the keys the caller's
  user typed (e.g. top_p -> "decode_sampling_nucleus_p"), so the error names the key to change.

  Raises:
    ValueError: unknown strategy; temperature < 0 or not finite, or 0 for a random strategy; top_k
      missing for "topk", < 1 or > vocab_size; top_p missing for "nucleus" or outside (0, 1].
  """
  n = {"strategy": "strategy", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
       **(names or {})}
  if strategy not in STRATEGIES:
    key = f" ({n['strategy']})" if n["strategy"] != "strategy" else ""
    raise ValueError(f"unknown sampling strategy {strategy!r}{key}; expected one of {STRATEGIES}")
  if temperature is None or not math.isfinite(float(temperature)) or float(temperature) < 0:
    raise ValueError(f"{n['temperature']} must be a finite number >= 0, got {temperature}")
  # Greedy never divides by the temperature, and 0 is the usual way to ask for it: accepted there.
  if strategy != "greedy" and float(temperature) == 0:
    raise ValueError(f"{n['temperature']} must be a finite number > 0 for {strategy!r}, got 0 (0 only fits "
                     f"greedy: pass {n['strategy']}=greedy)")
  if strategy == "topk":
    if top_k is None:
      raise ValueError(f"strategy 'topk' needs {n['top_k']} (an integer >= 1)")
    if int(top_k) != top_k or int(top_k) < 1:
      raise ValueError(f"{n['top_k']} must be an integer >= 1, got {top_k}")
    if vocab_size is not None and int(top_k) > vocab_size:
      raise ValueError(f"{n['top_k']}={top_k} exceeds the vocabulary size {vocab_size}")
  if strategy == "nucleus":
    if top_p is None:
      raise ValueError(f"strategy 'nucleus' needs {n['top_p']} in (0, 1]")
    if not 0.0 < float(top_p) <= 1.0:
      raise ValueError(f"{n['top_p']} must be in (0, 1], got {top_p}")


def row_params(strategy: str, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
  """`(greedy, temperature, top_k, top_p)` scalars of `sample_rows` for one validated configuration:
  top_k 0 and top_p 1 switch their filters off; greedy rows use temperature 1."""
  greedy = strategy == "greedy"
  return (greedy, 1.0 if greedy else float(temperature), int(top_k) if strategy == "topk" else 0,
          float(top_p) if strategy == "nucleus" else 1.0)


def sample_rows(logits, keys, greedy, temperature, top_k, top_p):
  """One token per row with per-row parameters.

  Args:
    logits: float `[B, V]` (computed in float32); -inf marks banned tokens.
    keys: `[B]` PRNG keys (row b draws with keys[b]), or None when every row is greedy.
    greedy: bool `[B]` (argmax, lowest id on ties). temperature: float32 `[B]` (> 0 where not greedy).
    top_k: int32 `[B]`, 0 = no top-k filter. top_p: float32 `[B]` in (0, 1], 1 = no nucleus filter.

  Returns:
    int32 `[B]` token ids.
  """
  logits = logits.astype(jnp.float32)
  v = logits.shape[-1]
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if keys is None:
    return best
  greedy, top_k, top_p = (jnp.broadcast_to(jnp.asarray(x), best.shape) for x in (greedy, top_k, top_p))
  temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), best.shape)

  def draw(_):
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    keep = jnp.arange(v)[None, :] < jnp.where(top_k > 0, top_k, v)[:, None]
    srt = jnp.where(keep, srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]   # the most likely always stays
    idx = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, srt, -jnp.inf))
    return jnp.where(greedy, best, jnp.take_along_axis(order, idx[:, None], axis=-1)[:, 0].astype(jnp.int32))

  # An all-greedy batch (the common serving case) skips the sort over the vocabulary.
  return jax.lax.cond(jnp.all(greedy), lambda _: best, draw, None)


def sample_step(logits, vocab_limit, greedy, temperature, top_k, top_p, seeds, positions):
  """`sample_rows` as the continuous engine's step runs it: ids >= `vocab_limit` banned, row s keyed
  `fold_in(key(seeds[s]), positions[s])` (a request's draws never depend on its neighbours or slot).

  Returns:
    `(tokens int32 [S], logprobs float32 [S], top2 float32 [S, 2])`: log_softmax of the untempered
    (vocab-limited) logits at the chosen id, and its two largest values (a near-tie check).
  """
  logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits.astype(jnp.float32), -jnp.inf)
  logp = jax.nn.log_softmax(logits, axis=-1)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, positions)
  tok = sample_rows(logits, keys, greedy, temperature, top_k, top_p)
  chosen = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  return tok, chosen, jax.lax.top_k(logp, 2)[0]


def _check_logits(logits) -> None:
  if logits.ndim != 2:
    raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")


def _sample(logits, key, params):
  greedy = params[0]
  keys = None if greedy else jax.random.split(key, logits.shape[0])
  return sample_rows(logits, keys, *params)


def sample_tokens(logits: jax.Array, key: jax.Array | None, *, strategy: str = "greedy",
                  temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
  """Chooses one token per row, every row with the same strategy (`sample_rows`; row b draws with
  the b-th key of `jax.random.split(key, B)`).

  Args:
    logits: floating `[B, V]` (computed in float32). -inf marks banned tokens.
    key: a `jax.random` key (typed or raw); may be None for "greedy".
    strategy, temperature, top_k, top_p: as `check_sampling_args`.

  Returns:
    int32 `[B]` token ids.

  Raises:
    ValueError: see `check_sampling_args`; logits not `[B, V]`; a missing key for a random strategy.
    TypeError: non-floating logits.
  """
  _check_logits(logits)
  check_sampling_args(strategy, temperature, top_k, top_p, vocab_size=logits.shape[-1])
  if strategy != "greedy" and key is None:
    raise ValueError(f"strategy {strategy!r} needs a PRNG key")
  return _sample(logits, key, row_params(strategy, temperature, top_k, top_p))


def make_sampler(strategy: str = "greedy", *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None):
  """Validates a configuration once and returns a jitted `fn(logits [B, V], key=None) -> int32 [B]`
  (the draws of `sample_tokens`; the key is ignored by greedy).

  Raises:
    ValueError: see `check_sampling_args`.
  """
  check_sampling_args(strategy, temperature, top_k, top_p)
  params = row_params(strategy, temperature, top_k, top_p)
  jitted = jax.jit(functools.partial(_sample, params=params))

  @functools.wraps(jitted)
  def sampler(logits, key=None):
    _check_logits(logits)
    check_sampling_args(strategy, temperature, top_k, top_p, vocab_size=logits.shape[-1])
    if strategy == "greedy":
      key = jax.random.key(0) if key is None else key  # unused; keeps one jit signature
    elif key is None:
      raise ValueError(f"strategy {strategy!r} needs a PRNG key")
    return jitted(logits, key)

  return sampler

