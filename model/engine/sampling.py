"""Next-token selection from logits `[B, V]` with an explicit PRNG key (JAX).

Strategies (the order of operations follows the usual "temperature, then filter" convention of
HF `generate` warpers and MaxText `sampling`):

  * "greedy":   argmax of the logits (ties -> lowest id); no key needed, temperature ignored.
  * "weighted": a draw from softmax(logits / temperature).
  * "topk":     the `top_k` largest logits only (exactly k candidates, ties broken by lower id),
                then a draw from softmax(kept / temperature).
  * "nucleus":  sort softmax(logits / temperature) descending and keep the shortest prefix whose
                mass reaches `top_p` (Holtzman et al. 2019, "The Curious Case of Neural Text
                Degeneration"); the most likely token is always kept; then draw from the kept
                tokens renormalised.

Parameters are static Python numbers, validated before tracing, so `make_sampler` returns one
jitted function per configuration.
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
  """Validates a sampling configuration.

  `names` maps the argument names ("strategy", "temperature", "top_k", "top_p") to the names the
  caller's user typed (a tool's config keys, e.g. "decode_sampling_nucleus_p"), so the error names
  the key to change.

  Raises:
    ValueError: unknown strategy; temperature < 0 or not finite, or 0 for a random strategy (greedy
      ignores the temperature, so 0 is accepted there); top_k missing for "topk", < 1 or
      > vocab_size; top_p missing for "nucleus" or outside (0, 1].
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


def _check_logits(logits) -> None:
  if logits.ndim != 2:
    raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")


def _nucleus_mask(sorted_logits: jax.Array, top_p: float) -> jax.Array:
  """bool `[B, V]` over logits sorted descending: the shortest prefix with mass >= top_p."""
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # A token is kept while the mass of strictly more likely tokens is still below p; index 0 has
  # mass_before == 0 < p, so at least one token always survives.
  return mass_before < top_p


def sample_tokens(logits: jax.Array, key: jax.Array | None, *, strategy: str = "greedy",
                  temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
  """Chooses one token per row.

  Args:
    logits: floating `[B, V]` (any float dtype; computed in float32). -inf marks banned tokens.
    key: a `jax.random` key (typed or raw uint32 `[2]`); may be None for "greedy".
    strategy: "greedy", "weighted", "topk" or "nucleus".
    temperature: > 0; logits are divided by it before softmax (not used by "greedy").
    top_k: number of candidates for "topk".
    top_p: cumulative-probability threshold in (0, 1] for "nucleus".

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
  return _sample(logits, key, strategy, 1.0 if strategy == "greedy" else float(temperature),
                 None if top_k is None else int(top_k), None if top_p is None else float(top_p))


def _sample(logits, key, strategy, temperature, top_k, top_p):
  logits = logits.astype(jnp.float32)
  if strategy == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / temperature
  if strategy == "weighted":
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  if strategy == "topk":
    # Sample among exactly the k candidates lax.top_k returns, then map back to vocabulary ids:
    # thresholding at the k-th value would admit extra tokens that tie with it.
    vals, idx = jax.lax.top_k(scaled, top_k)
    choice = jax.random.categorical(key, vals, axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  # nucleus
  order = jnp.argsort(-scaled, axis=-1, stable=True)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  kept = jnp.where(_nucleus_mask(sorted_logits, top_p), sorted_logits, -jnp.inf)
  choice = jax.random.categorical(key, kept, axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def make_sampler(strategy: str = "greedy", *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None):
  """Validates a configuration once and returns a jitted `fn(logits [B, V], key) -> int32 [B]`.

  For "greedy" the key argument is ignored (pass None or any key). `top_k` is checked against V at
  the first call.

  Raises:
    ValueError: see `check_sampling_args`.
  """
  check_sampling_args(strategy, temperature, top_k, top_p)
  temperature = 1.0 if strategy == "greedy" else float(temperature)  # unused by greedy
  top_k = None if top_k is None else int(top_k)
  top_p = None if top_p is None else float(top_p)

  @jax.jit
  def _jitted(logits, key):
    return _sample(logits, key, strategy, temperature, top_k, top_p)

  @functools.wraps(_jitted)
  def sampler(logits, key=None):
    _check_logits(logits)
    check_sampling_args(strategy, temperature, top_k, top_p, vocab_size=logits.shape[-1])
    if strategy == "greedy":
      key = jax.random.key(0) if key is None else key  # unused; keeps one jit signature
    elif key is None:
      raise ValueError(f"strategy {strategy!r} needs a PRNG key")
    return _jitted(logits, key)

  return sampler
