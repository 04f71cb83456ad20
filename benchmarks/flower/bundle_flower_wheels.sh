#!/usr/bin/env bash
# Build .whl-flower/: what Flower needs on the offline GPU host on top of ../shared/device/bundle-wheels.sh's
# .whl/ (ray 2.60, pydantic, open_clip, ...) and the host's own packages (grpcio, protobuf, httpx, click,
# rich, typer, pathspec, pyyaml, requests, ...). flwr goes in with --no-deps, so it runs on ray 2.60, not
# the ray 2.55.1 its [simulation] extra pins (ray's wheel would not fit the 64 MiB a call carries twice).
# Only the modules Flower's simulation imports are listed (found by tracing a run here); uv, uvicorn and
# prompt-toolkit are left out (the flwr CLI's). protobuf goes to fallback/: installed only if the host's
# protobuf is older than 5.29 (flwr's generated code needs 5.29 or newer).
# Usage, from the project root:   bash benchmarks/flower/bundle_flower_wheels.sh
# On the GPU host:  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-flower/*.whl
set -euo pipefail
out=.whl-flower
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/fallback"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" \
  flwr==1.42.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 \
  alembic==1.20.1 Mako==1.4.3 fastapi==0.138.2 starlette==1.3.1 iterators==0.0.2 tomli_w==1.2.0 \
  grpcio-health-checking==1.81.1
# pure-Python builds (smaller; SQLAlchemy's C speed-ups are not needed here)
python3 -m pip download -q --no-deps --only-binary=:all: --platform any --python-version 3.12 -d "$out" \
  SQLAlchemy==2.1.9 tomli==2.5.0
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/fallback" protobuf==6.33.6
du -sh "$out"; ls "$out"
