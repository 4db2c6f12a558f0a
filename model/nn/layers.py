"""Generic host layers: dtype handling, initialisers with logical axes, RMSNorm, linear, SwiGLU.

Logical axis names used on every parameter (the sharding engineer maps them to mesh axes):
`embed` (residual width d), `heads` (attention/KDA heads x head dim, flattened), `kv` (MLA latent),
`mlp` (FFN width), `expert` (stacked experts), `vocab`; None = replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def as_dtype(name: str):
  """Maps a config dtype name ("float32", "bfloat16") to a jnp dtype (ValueError otherwise)."""
  if name not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
  return DTYPES[name]


def normal_init(std: float, axes: tuple):
  """Normal(0, std) initialiser annotated with logical axis names."""
  return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def param(init, key, shape, dtype, axes: tuple) -> nnx.Param:
  """An `nnx.Param` holding `init(key, shape, dtype)`, annotated with logical `axes`."""
  return nnx.Param(init(key, shape, dtype), out_sharding=axes)


def linear(din: int, dout: int, axes: tuple, args, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free `nnx.Linear` (kernel `[din, dout]`, i.e. the HF weight transposed).

  Parameters in `args.weight_dtype`, compute in `args.dtype`.
  """
  return nnx.Linear(din, dout, use_bias=False, dtype=as_dtype(args.dtype),
                    param_dtype=as_dtype(args.weight_dtype),
                    kernel_init=normal_init(args.initializer_range, axes), rngs=rngs)


class RMSNorm(nnx.Module):
  """`scale * (x / sqrt(mean(x^2) + eps))`, normalised in float32 then cast back, as HF
  `KimiLinearRMSNorm` (T5 style: no mean subtraction, no bias).

  Args:
    dim: normalised (last) dimension. eps: epsilon inside the square root.
    param_dtype / dtype: storage and output dtypes. axes: logical axes of `scale`.
  Shapes: `[..., dim]` -> `[..., dim]` in `dtype`.
  """

  def __init__(self, dim: int, *, eps: float, param_dtype, dtype, axes=("embed",)):
    self.eps = float(eps)
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=axes)

  def normalize(self, x):
    """float32 `x / sqrt(mean(x^2) + eps)` (no scale)."""
    xf = jnp.asarray(x, jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)

  def __call__(self, x):
    y = self.normalize(x).astype(self.dtype)
    return (self.scale[...].astype(self.dtype) * y).astype(self.dtype)


class SwiGLU(nnx.Module):
  """`down_proj(silu(gate_proj x) * up_proj x)`: HF `KimiMLP` (dense FFN and shared experts).

  Parameters: `gate_proj.kernel [d, I]`, `up_proj.kernel [d, I]`, `down_proj.kernel [I, d]`.
  """

  def __init__(self, d: int, inner: int, args, rngs: nnx.Rngs):
    self.gate_proj = linear(d, inner, ("embed", "mlp"), args, rngs)
    self.up_proj = linear(d, inner, ("embed", "mlp"), args, rngs)
    self.down_proj = linear(inner, d, ("mlp", "embed"), args, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def uniform_init(lo: float, hi: float):
  """Uniform(lo, hi) float32 initialiser (used for the short-conv taps, as PyTorch Conv1d)."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, lo, hi)
  return init


def inverse_softplus(y):
  """`x` with `softplus(x) = y` (float32, y > 0), for the dt_bias initialisation."""
  y = jnp.asarray(y, jnp.float32)
  return y + jnp.log(-jnp.expm1(-y))
