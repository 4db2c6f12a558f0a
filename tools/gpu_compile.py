"""Deviceless ahead-of-time compile of `kda_inference(implementation="pallas_gpu")` for an NVIDIA GPU (sm_90a).

Runs in the CUDA-plugin venv (`.venv-gpu-aot`) on a CPU-only host: XLA's Triton passes, LLVM to PTX and
ptxas to a cubin, the pipeline a device runs. The target is one of the `GpuTargetConfigProto` text
protos that the jax CUDA plugin embeds in `xla_cuda_plugin.so` (e.g. "NVIDIA H200 141GB HBM3e").
`compile_kda` must be the only compile of its process (the environment below is read once by XLA).

Reported per KDA kernel (PTX `.entry`): the PTX text, its tensor-core (`mma.sync`, `wgmma`),
`fma.rn.f32`, `cp.async` (software-pipelined loads) and `ex2.approx` (static: loop bodies
count once) instruction counts, and ptxas' registers, stack frame and spill bytes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import tempfile
import threading
import time

DEVICES = {"h200": "NVIDIA H200 141GB HBM3e", "h100": "NVIDIA H100 80GB HBM3"}
KDA_KERNELS = ("kda_gpu_chunk_prep", "kda_gpu_state_pass")


def _site_packages() -> pathlib.Path:
  import jax_plugins  # noqa: PLC0415  (only in the CUDA-plugin venv)
  return pathlib.Path(jax_plugins.__path__[0]).parent


def target_config(device: str) -> str:
  """The plugin's GpuTargetConfigProto text whose `device_description_str` is exactly `device`."""
  so = next((_site_packages() / "jax_plugins").glob("xla_cuda*/xla_cuda_plugin.so"))
  data = so.read_bytes()
  needle = f'device_description_str: "{device}"'.encode()
  i = data.find(needle + b"\n")
  if i < 0:
    raise ValueError(f"no GPU target config for {device!r} in {so}")
  start = data.rfind(b"\x00", 0, i) + 1
  end = data.find(b"\x00", i)
  return data[start:end].decode()


def prepare_environment(dump_dir: str, *, fail_on_spill: bool = True) -> None:
  """Sets what XLA reads at start-up: CPU host, ptxas from the nvcc wheel first on PATH, the ptxas -v
  log (C++ VLOG of subprocess_compilation), XLA's temporary directory, optionally spills as errors."""
  nvcc_bin = _site_packages() / "nvidia" / "cuda_nvcc" / "bin"
  os.environ["PATH"] = f"{nvcc_bin}{os.pathsep}{os.environ.get('PATH', '')}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
  os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=3"
  tmp = pathlib.Path(dump_dir) / "tmp"
  tmp.mkdir(parents=True, exist_ok=True)
  os.environ["TMPDIR"] = str(tmp)
  if fail_on_spill:
    flags = "--xla_gpu_fail_ptx_compilation_on_register_spilling=true"
    os.environ["XLA_FLAGS"] = f"{flags} {os.environ.get('XLA_FLAGS', '')}".strip()


class PtxKeeper:
  """Keeps the PTX that XLA hands to ptxas. XLA writes each kernel's PTX to a file in TMPDIR and deletes
  it once ptxas is done (no dump flag keeps it); this thread hard-links every new file there into
  `dest` while it exists (ptxas takes milliseconds to seconds), so the text survives the delete."""

  def __init__(self, tmp: pathlib.Path, dest: pathlib.Path):
    self.tmp, self.dest = tmp, dest
    dest.mkdir(parents=True, exist_ok=True)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    seen = set()
    while not self._stop.is_set():
      for entry in os.scandir(self.tmp):
        if entry.name not in seen:
          seen.add(entry.name)
          try:
            os.link(entry.path, self.dest / entry.name)
          except OSError:
            pass
      time.sleep(0.002)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  def ptx(self) -> str:
    texts = [p.read_text(errors="replace") for p in sorted(self.dest.iterdir())]
    return "\n".join(t for t in texts if ".entry" in t and ".version" in t)


@dataclasses.dataclass
class KernelReport:
  name: str
  ptx: str
  mma: int
  wgmma: int
  fma_f32: int
  cp_async: int
  ex2: int
  registers: int | None = None
  stack_bytes: int | None = None
  spill_store_bytes: int | None = None
  spill_load_bytes: int | None = None
  shared_bytes: int | None = None


def split_entries(ptx: str) -> dict[str, str]:
  """PTX text per `.entry` (kernel name -> its body, up to the next entry or function)."""
  starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+([\w$]+)", ptx)]
  out = {}
  for (pos, name), nxt in zip(starts, starts[1:] + [(len(ptx), None)]):
    out[name] = ptx[pos:nxt[0]]
  return out


def count_instructions(ptx: str) -> dict[str, int]:
  return {"mma": len(re.findall(r"\bmma\.sync\.", ptx)),
          "wgmma": len(re.findall(r"\bwgmma\.mma_async\.", ptx)),
          "fma_f32": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
          "cp_async": len(re.findall(r"\bcp\.async\.", ptx)),
          "ex2": len(re.findall(r"\bex2\.approx\.", ptx))}


_PTXAS_FN = re.compile(r"Function properties for ([\w$]+)\s*\n?.*?(\d+) bytes stack frame, (\d+) bytes "
                       r"spill stores, (\d+) bytes spill loads", re.S)
_PTXAS_REG = re.compile(r"Compiling entry function '([\w$]+)'.*?Used (\d+) registers(?:.*?(\d+) bytes smem)?",
                        re.S)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
  """ptxas -v lines per kernel: registers, stack frame, spill store/load bytes, static shared memory."""
  info: dict[str, dict[str, int]] = {}
  for m in _PTXAS_FN.finditer(log):
    info.setdefault(m.group(1), {}).update(stack_bytes=int(m.group(2)), spill_store_bytes=int(m.group(3)),
                                           spill_load_bytes=int(m.group(4)))
  for m in _PTXAS_REG.finditer(log):
    d = info.setdefault(m.group(1), {})
    d["registers"] = int(m.group(2))
    if m.group(3):
      d["shared_bytes"] = int(m.group(3))
  return info


def seed_args(batch, seq_len, heads, key_dim, value_dim, dtype, num_segments):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  sds = jax.ShapeDtypeStruct
  dt = jnp.dtype(dtype)
  return [sds((batch, seq_len, heads, key_dim), dt), sds((batch, seq_len, heads, key_dim), dt),
          sds((batch, seq_len, heads, value_dim), dt), sds((batch, seq_len, heads, key_dim), jnp.float32),
          sds((batch, seq_len, heads), dt), sds((batch, seq_len), jnp.int32),
          sds((heads,), jnp.float32), sds((heads * key_dim,), jnp.float32)]


def compile_kda(*, device="h200", batch=1, seq_len=8192, heads=8, key_dim=128, value_dim=128,
                dtype="bfloat16", num_segments=2, lower_bound=-5.0, with_h0=False, fail_on_spill=True):
  """Compiles kda_inference (in-kernel gate, q/k L2 norm, final states) deviceless for `device`.

  Returns (reports {kernel name: KernelReport}, seconds for lower + compile, full ptxas log).
  """
  dump = tempfile.mkdtemp(prefix="kda_gpu_aot_")
  prepare_environment(dump, fail_on_spill=fail_on_spill)
  log_path = pathlib.Path(dump) / "stderr.log"
  # ptxas -v goes to XLA's C++ log on stderr: capture file descriptor 2 for the compile.
  keeper = PtxKeeper(pathlib.Path(dump) / "tmp", pathlib.Path(dump) / "ptx")
  saved = os.dup(2)
  fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 2)
  try:
    import jax  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    from kda_plugin.ops.inference import kda_inference  # noqa: PLC0415
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(DEVICES[device]),
                                        topology="1x1x1")
    mesh = Mesh(topo.devices[:1], ("x",))
    shard = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard)
            for a in seed_args(batch, seq_len, heads, key_dim, value_dim, dtype, num_segments)]
    if with_h0:
      args.append(jax.ShapeDtypeStruct((batch, num_segments, heads, key_dim, value_dim), "float32",
                                       sharding=shard))

    def f(q, k, v, g, beta, seg, a_log, dt_bias, *h0):
      return kda_inference(q, k, v, g, beta, segment_ids=seg, initial_state=h0[0] if h0 else None,
                           output_final_state=True, a_log=a_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, use_qk_l2norm=True, max_num_segments=num_segments,
                           implementation="pallas_gpu")

    t0 = time.perf_counter()
    with keeper, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      jax.jit(f).lower(*args).compile()
    seconds = time.perf_counter() - t0
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(fd)
    os.close(saved)
  log = log_path.read_text(errors="replace")
  ptx = keeper.ptx()
  entries = split_entries(ptx)
  ptxas = parse_ptxas(log)
  reports = {}
  for name, body in entries.items():
    base = next((k for k in KDA_KERNELS if name.startswith(k)), None)
    if base is None:
      continue
    reports[name] = KernelReport(name=name, ptx=body, **count_instructions(body), **ptxas.get(name, {}))
  missing = [k for k in KDA_KERNELS if not any(n.startswith(k) for n in reports)]
  if missing:
    raise RuntimeError(f"no PTX found for {missing} in {dump} (entries: {sorted(entries)})")
  return reports, seconds, log


# --- fla's chunk_kda, compiled by Triton for sm_90a without a device ------------------------------
# Run in a scratch venv OUTSIDE the repo with torch (CPU wheel), triton and flash-linear-attention:
#   python -m tools.gpu_compile fla_out=DIR
# then `.venv-gpu-aot/bin/python -m tools.gpu_cost ptx_dir=DIR ptxas=<triton>/backends/nvidia/bin/ptxas-blackwell`.
FLA_SEED = dict(batch=1, seq_len=8192, heads=8, key_dim=128, value_dim=128, split=8192 // 2 - 17,
                lower_bound=-5.0)


def capture_fla_launches(out_dir: str) -> dict:
  """Runs fla `chunk_kda`'s forward (seed shape FLA_SEED, bf16, two documents through cu_seqlens,
  in-kernel bounded gate with safe_gate, in-kernel q/k L2 norm, final state) on CPU tensors under a
  stand-in CUDA driver whose target is GPUTarget("cuda", 90, 32): every Triton kernel it launches is
  compiled by Triton's own pipeline with that launch's specialisation and constexprs, and instead of
  launching, the grid, warps, stages, hash and bytes of its tensor arguments are recorded. Autotuned
  kernels cannot be timed here: every candidate config is compiled (recorded with its `config`) and
  the first is launched (recorded with config None). Writes DIR/<name>.<hash[:10]>.ptx and
  DIR/launches.json; returns counts."""
  import json  # noqa: PLC0415
  import types  # noqa: PLC0415

  import torch  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.backends.nvidia.driver import CudaDriver  # noqa: PLC0415
  from triton.compiler.compiler import CompiledKernel  # noqa: PLC0415
  from triton.runtime import driver  # noqa: PLC0415
  from triton.runtime.autotuner import Autotuner  # noqa: PLC0415

  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  target = GPUTarget("cuda", 90, 32)

  class StandInDriver:  # what Triton's JIT and fla's hardware probe ask of a CUDA driver
    utils = types.SimpleNamespace(get_device_properties=lambda i: dict(
        max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32))
    is_active = staticmethod(lambda: True)
    get_current_device = staticmethod(lambda: 0)
    set_current_device = staticmethod(lambda d: None)
    get_current_stream = staticmethod(lambda d=None: 0)
    get_current_target = staticmethod(lambda: target)
    get_active_torch_device = staticmethod(lambda: torch.device("cpu"))
    get_device_interface = staticmethod(lambda: torch.cuda)

    def map_python_to_cpp_type(self, ty):
      return CudaDriver.map_python_to_cpp_type(self, ty)

  driver.set_active(StandInDriver())
  props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                total_memory=141 << 30, shared_memory_per_block_optin=232448,
                                max_shared_memory_per_block_optin=232448)
  torch.cuda.get_device_name = lambda *a, **k: props.name
  torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
  torch.cuda.current_device = lambda: 0
  torch.cuda.device_count = lambda: 1
  torch.cuda.get_device_properties = lambda *a, **k: props

  class NoDevice:
    def __init__(self, *a, **k):
      pass

    def __enter__(self):
      return self

    def __exit__(self, *a):
      return False

  torch.cuda.device = NoDevice
  launches, seen, tuning = [], set(), {"config": None}

  def record_launch(kernel):
    def run(g0, g1, g2, stream, fn, packed, meta, enter, exit_, *args):
      launches.append(dict(name=kernel.name, grid=[g0, g1, g2], num_warps=kernel.metadata.num_warps,
                           num_stages=kernel.metadata.num_stages, hash=kernel.hash,
                           config=tuning["config"], tensor_bytes=sum(
                               a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))))
    return run

  CompiledKernel.run = property(record_launch)
  CompiledKernel.launch_metadata = lambda self, grid, stream, *a: None
  init = CompiledKernel.__init__

  def keep_ptx(self, *a, **k):
    init(self, *a, **k)
    if self.hash not in seen:
      seen.add(self.hash)
      (out / f"{self.name}.{self.hash[:10]}.ptx").write_text(self.asm["ptx"])

  CompiledKernel.__init__ = keep_ptx

  def compile_candidate(self, *args, config, **meta):
    tuning["config"] = str(config)
    try:
      self.fn.run(*args, **dict(meta, **config.all_kwargs()))
    finally:
      tuning["config"] = None
    return [1.0, 1.0, 1.0]  # equal "timings": the first config is the one launched

  Autotuner._bench = compile_candidate
  from fla.ops.kda import chunk_kda  # noqa: PLC0415

  s = FLA_SEED
  b, t, h, k, v = s["batch"], s["seq_len"], s["heads"], s["key_dim"], s["value_dim"]
  bf = torch.bfloat16
  with torch.no_grad():
    chunk_kda(torch.randn(b, t, h, k, dtype=bf), torch.randn(b, t, h, k, dtype=bf),
              torch.randn(b, t, h, v, dtype=bf), torch.randn(b, t, h, k, dtype=bf),
              torch.rand(b, t, h, dtype=bf), A_log=torch.zeros(h), dt_bias=torch.zeros(h * k),
              use_gate_in_kernel=True, safe_gate=True, lower_bound=s["lower_bound"],
              use_qk_l2norm_in_kernel=True, output_final_state=True,
              cu_seqlens=torch.tensor([0, s["split"], t], dtype=torch.int32))
  (out / "launches.json").write_text(json.dumps(launches, indent=1))
  return dict(launches=sum(1 for l in launches if l["config"] is None), compiled=len(seen))


if __name__ == "__main__":
  import json as _json
  _args = dict(a.partition("=")[::2] for a in sys.argv[1:])
  if set(_args) != {"fla_out"}:
    print("error: usage: python -m tools.gpu_compile fla_out=DIR (in a venv with torch, triton, "
          "flash-linear-attention)", file=sys.stderr)
    sys.exit(2)
  print(_json.dumps(capture_fla_launches(_args["fla_out"])))
