"""Builds the engine an `EngineConfig` names: "continuous" (model.engine.continuous) or "static"
(model.engine.static, the static-batcher baseline)."""

from __future__ import annotations

from model.engine.config import EngineConfig
from model.engine.continuous import ContinuousEngine
from model.engine.static import StaticEngine


def build_engine(config: EngineConfig, model, *, vocab_limit: int | None = None, mesh=None, rules=None):
  """The engine of `config.engine` over `model` (sizes validated by `EngineConfig`).

  Raises:
    GenerationError: vocab_limit outside [1, the model's vocabulary].
  """
  if config.engine == "static":
    return StaticEngine(model, config, vocab_limit=vocab_limit, mesh=mesh, rules=rules)
  return ContinuousEngine(model, config, vocab_limit=vocab_limit, mesh=mesh, rules=rules)
