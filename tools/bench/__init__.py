"""Benchmark scripts (run as `python tools/bench/NAME.py`), not console commands: the serving and
conversion benchmarks, the decode-routing measurement, the online load generator (`serving_load`)
and the transformers reference (`reference/`, run in a torch venv). Their figures are in
docs/performance.md and docs/serving.md."""
