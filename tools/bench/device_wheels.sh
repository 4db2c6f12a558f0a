#!/usr/bin/env bash
# Wheels of the packages the lent TPU's own index (file:///opt/pypi/simple) lacks, downloaded here into
# .whl-tpu/ (git-ignored) for the device tool's `carry` (64 MiB at most, with the working tree).
# tools/bench/e2e_device_check.sh installs from the index and this directory together (pip --find-links),
# so a wheel here only has to fill the gap; the packages' own needs come from the index.
#
# Usage: tools/bench/device_wheels.sh [NAME==VERSION ...]
#   default: what the index lacked when it was last read (see docs/serving.md, "On the lent TPU"):
#   orbax-checkpoint at the version this checkout's .venv has (the index holds an older one, without
#   the orbax.checkpoint.experimental.v1 API that the checkpoint writer uses), with its small needs
#   uvloop, aiofiles, humanize, simplejson, etils at this .venv's versions.
#   env: DEST (default .whl-tpu), PIP (default: .venv/bin/python -m pip, else python3 -m pip).
# Then run the check with carry [".whl-tpu"]; the script finds it at $ROOT/.whl-tpu (WHEELS= overrides).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl-tpu}
if [ -z "${PIP:-}" ]; then
  if [ -x .venv/bin/python ]; then PIP=".venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  # orbax-checkpoint, and those of its needs that an index holding an older orbax may lack (small; a
  # package the index has as well is simply installed once, at the version pip prefers)
  for pkg in orbax-checkpoint uvloop aiofiles humanize simplejson etils; do
    version=$($PIP show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] && names+=("$pkg==$version")
  done
  [ ${#names[@]} -gt 0 ] || names=("orbax-checkpoint==0.12.8")
fi
mkdir -p "$DEST"
# the target: the chip's CPython 3.11 on x86-64, manylinux2014 (glibc 2.17: runs on any newer glibc)
# shellcheck disable=SC2086  # PIP is a command line
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${names[@]}"
du -sh "$DEST"
ls -l "$DEST"
size=$(du -sm "$DEST" | cut -f1)
[ "$size" -lt 48 ] || echo "warning: $DEST holds ${size} MiB; the working tree and carried paths travel within 64 MiB"
