"""Build the int8 model (models/all-MiniLM-L6-v2-int8, the default document and query model) from the fp32 ONNX model.

Dynamic per-channel int8 quantisation of the weights (onnxruntime.quantization), run in a throwaway venv since
it needs the ``onnx`` package, which the runtime does not::

    python3.11 -m venv /tmp/quantize-venv && /tmp/quantize-venv/bin/pip install onnx onnxruntime==1.32.0
    /tmp/quantize-venv/bin/python scripts/quantize_query.py

Queries embedded by it land in the fp32 model's space (mean cosine ~0.99 to fp32), so stored vectors stay as
they are: it serves as ``embedder.query_model`` only. Tokenizer files and the licence are copied beside it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "models" / "all-MiniLM-L6-v2"
TARGET = REPO / "models" / "all-MiniLM-L6-v2-int8"
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "LICENSE")


def main() -> None:
    """Quantise the model and copy what fastembed needs beside it (the manifest is kept as committed)."""
    TARGET.mkdir(parents=True, exist_ok=True)
    quantize_dynamic(SOURCE / "model.onnx", TARGET / "model.onnx", weight_type=QuantType.QInt8, per_channel=True)
    for name in COPIED:
        shutil.copy(SOURCE / name, TARGET / name)
    shutil.copytree(SOURCE / "1_Pooling", TARGET / "1_Pooling", dirs_exist_ok=True)
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
