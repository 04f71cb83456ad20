#!/usr/bin/env bash
# Flower's own virtual environment for the side-by-side benchmark (benchmarks/flower/).
#
# Flower pins its own Ray (flwr 1.42 -> ray 2.55.1), which cannot live next to rayfed's Ray 2.60,
# so Flower gets a venv of its own. rayfed is installed into it with --no-deps, editable: the Flower apps
# reuse rayfed's model (build_backbone / build_client_model), data (build_federation) and local
# training step (ClientContext.train) so that both frameworks run exactly the same client work.
#
# Usage, from anywhere:   bash benchmarks/flower/setup_venv.sh [--ray VERSION]
#   FLOWER_VENV   where to create it (default: benchmarks/flower/.venv)
#   FLWR_VERSION  Flower release (default 1.42.0, the latest on PyPI when this was written)
#   --ray V       afterwards force-install ray==V with --no-deps over Flower's pin (what the GPU
#                 host does: only ray 2.60 travels there), to check Flower's simulation runs on it
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${FLOWER_VENV:-$here/.venv}
flwr_version=${FLWR_VERSION:-1.42.0}
ray_override=""
if [[ "${1:-}" == "--ray" ]]; then ray_override=${2:?--ray needs a version}; fi

python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# torch/torchvision: the releases rayfed's venv uses (and this machine's pip is capped to).
"${pip[@]}" install -q "flwr[simulation]==$flwr_version" torch==2.14.1 torchvision==0.29.1 \
    transformers peft open_clip_torch datasets safetensors scikit-learn numpy psutil pydantic PyYAML matplotlib tqdm
"${pip[@]}" install -q --no-deps --no-build-isolation -e "$root"  # editable: always this checkout's rayfed
if [[ -n "$ray_override" ]]; then
    "${pip[@]}" install -q --no-deps --force-reinstall "ray==$ray_override"
fi
"$venv/bin/python" - <<'PY'
import flwr, ray, torch, transformers, peft, open_clip
print(f"flower venv ready: flwr {flwr.__version__}, ray {ray.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}, open_clip {open_clip.__version__}")
PY
