"""model.aot reads libtpu's compile-time out-of-memory text into a "does not fit" report (no libtpu needed:
the message below is the one libtpu 0.0.52 gave for a decode batch of 262144 on v5e:2x2)."""

from __future__ import annotations

import jax
import pytest

from model import aot

MESSAGE = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
           "for HLO temporaries (33.05G) exceeds available HBM (15.75G). HLO module: jit_decode.\n"
           "See https://openxla.org/xla/errors/error_1000 for more details.")


def test_refused_program_is_a_does_not_fit_report():
  e = jax.errors.JaxRuntimeError(MESSAGE)
  assert aot.is_compile_oom(e)
  assert aot.oom_bytes(e) == (round(33.05 * 2**30), round(15.75 * 2**30))
  m = aot.refused_report(e, hbm_bytes=1)  # libtpu's stated figure wins over the caller's
  assert m["hbm_bytes"] == 15.75 * 2**30 and m["total_bytes"] == round(33.05 * 2**30)
  assert not m["fits"] and m["refused_by_compiler"] and m["argument_bytes"] is None
  line = aot.verdict(m, "TPU v5 lite")
  assert line.startswith("does not fit in 15.75 GiB usable HBM per TPU v5 lite device (libtpu) by 17.30 GiB")
  # "memory required for HLO temporaries" is libtpu's wording for the whole program's bytes (see
  # model.aot.refused_report): reported as the total, not as temporaries.
  assert "needs 33.05 GiB" in line and m["temp_bytes"] is None
  assert m["compiler_detail"].endswith("for more details.")


def test_other_errors_are_not_taken_for_memory():
  assert not aot.is_compile_oom(jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed to compile"))
  assert not aot.is_compile_oom(ValueError("RESOURCE_EXHAUSTED: not from XLA"))
  assert aot.oom_bytes(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")) == (None, None)
  m = aot.refused_report(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"), hbm_bytes=2**30)
  assert m["total_bytes"] is None and m["margin_bytes"] is None and m["hbm_bytes"] == 2**30
  assert aot.verdict(m, "TPU v5").startswith("does not fit in 1.00 GiB usable HBM per TPU v5 device (libtpu) (")


@pytest.mark.parametrize("total, fits", [(15 * 2**30, True), (16 * 2**30, False)])
def test_memory_analysis_verdict_uses_usable_hbm(total, fits):
  hbm = round(15.75 * 2**30)
  m = {"total_bytes": total, "hbm_bytes": hbm, "fits": total <= hbm, "margin_bytes": hbm - total,
       "refused_by_compiler": False}
  line = aot.verdict(m, "TPU v5 lite")
  assert line.startswith("fits: 15.00 GiB of 15.75 GiB" if fits else
                         "does not fit in 15.75 GiB usable HBM per TPU v5 lite device (libtpu) by 0.25 GiB")


def test_a_topology_libtpu_cannot_route_is_a_config_error(monkeypatch):
  """libtpu describes `v5e:9x9` (81 devices) but fails compiling its first collective with this internal
  error (libtpu 0.0.52, a train step); tools.aot_compile printed it as a traceback with exit 1. It is a
  bad `compile_topology` (exit 2, one line)."""
  from model.config import ConfigError, load_config

  class Lowered:
    def compile(self):
      raise jax.errors.JaxRuntimeError(
          "INTERNAL: RET_CHECK failure (platforms/xla/service/jellyfish/lowering/net_util.cc:2326) info.has_value() "
          "Failed to create limited ICI routing replica info table")

  monkeypatch.setattr(aot, "lower", lambda cfg, mode, mesh, **kw: (Lowered(), {}))
  target = aot.Target("v5e:9x9", 1, tuple(jax.devices()[:1]), "TPU v5 lite", 2**30, 2**30)
  with pytest.raises(ConfigError, match=r"^compile_topology='v5e:9x9': libtpu cannot route collectives between "
                                        r"its 1 devices: not a slice shape this TPU generation offers"):
    aot.compile_for(load_config(["tiny"]), "train", target)
