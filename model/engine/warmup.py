"""Start-up compilation of an engine, made visible: a tqdm bar over the step executables, a line per
executable (name, shape bucket, seconds, compiled or loaded from the persistent compilation cache)
and a summary the timing tools print and record (`tools.serve`, the serving benchmarks, the device
check).

On the lent TPU a cold start of the 0.9B test model compiles each step for 12-35 s, so a server that
says nothing for minutes looks hung; these lines say what it is doing and how long it takes.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from tqdm import tqdm

from model.engine import compilation_cache


@dataclasses.dataclass
class CompileReport:
  """What `compile_engine` did. `seconds`: wall time; `executables`: step executables made ready;
  `compiled` / `from_cache` / `shared`: of those, compiled by XLA / loaded from jax's persistent cache
  / already held by this process; `records`: one dict per executable (name, seconds, how);
  `cache_dir`: the persistent cache's directory (None: off)."""

  seconds: float = 0.0
  executables: int = 0
  compiled: int = 0
  from_cache: int = 0
  shared: int = 0
  records: list = dataclasses.field(default_factory=list)
  cache_dir: str | None = None

  def summary(self) -> str:
    """One line, e.g. "compiled 12 step executables in 83.2 s: 3 compiled, 9 loaded from the
    persistent compilation cache (~/.cache/kda_plugin/jax)"."""
    parts = [f"{self.compiled} compiled"]
    if self.from_cache:
      parts.append(f"{self.from_cache} loaded from the persistent compilation cache")
    if self.shared:
      parts.append(f"{self.shared} already in this process")
    where = f"cache {self.cache_dir}" if self.cache_dir else "persistent compilation cache off"
    return (f"compiled {self.executables} step executables in {self.seconds:.1f} s: {', '.join(parts)} "
            f"({where})")

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _how(record) -> str:
  if record.shared:
    return "already compiled in this process"
  return {True: "loaded from the persistent cache", False: "compiled", None: "compiled (no persistent cache)"}[
      record.cached]


def compile_engine(engine, *, progress: bool = True, threads: int | None = None, file=None) -> CompileReport:
  """Compiles every executable `engine` will run (`compile_all`, where the engine has it: the
  continuous engine) with a tqdm bar on `file` (default stderr) when `progress`, one line per
  executable and the summary line. An engine without `compile_all` (the static batcher compiles per
  group shape on first use) gives an empty report."""
  file = sys.stderr if file is None else file
  report = CompileReport(cache_dir=compilation_cache.directory())
  if not hasattr(engine, "compile_all"):
    return report
  total = engine.runner.max_compilations
  bar = tqdm(total=total, desc="compiling step executables", unit="exe", file=file, leave=False,
             disable=not progress, dynamic_ncols=True)

  def done(record):
    report.records.append({"name": record.name, "seconds": round(record.seconds, 3), "how": _how(record)})
    report.executables += 1
    if record.shared:
      report.shared += 1
    elif record.cached:
      report.from_cache += 1
    else:
      report.compiled += 1
    bar.update(1)
    if len(traced) >= total:   # every program traced: the bar counts compilations only
      bar.set_description_str("compiling step executables")
    bar.set_postfix_str(f"{record.name}: {record.seconds:.1f} s")
    if progress:
      tqdm.write(f"  {record.name:<22} {record.seconds:7.1f} s  {_how(record)}", file=file)

  traced = []

  def tracing(name):
    traced.append(name)
    bar.set_description_str(f"tracing {name} ({len(traced)}/{total}), compiled")

  t0 = time.perf_counter()
  try:
    engine.compile_all(done, threads=threads, on_tracing=tracing)
  finally:
    bar.close()
  report.seconds = time.perf_counter() - t0
  print(report.summary(), file=file, flush=True)
  return report
