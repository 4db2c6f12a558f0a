"""The project's checkpoint on disk: the format (`format`), its checksums (`checksums`) and the
filtering of Orbax's log output (`orbax_logs`). Imports no model, loading or conversion code."""
