"""The shipped model files: where a model directory is looked for, and its manifest.

A model directory (``models/<name>``) holds an ONNX export or a static query model and a ``manifest.json``
saying what its vectors are. The wheel carries ``models/`` as package data of the top-level package
(``proxy/models``); a checkout or editable install has it beside the package; the cwd is tried last. The
directories are found from this file's own location, so the memory core imports nothing of the HTTP shell to
find them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.memory.errors import EmbedderError

_Manifest = TypeVar("_Manifest", bound=BaseModel)
_PACKAGE_DIR = Path(__file__).parents[2]  # the top-level package directory: <package>/memory/embedders/this file

ONNX_MODEL_DIR_NAME = "all-MiniLM-L6-v2-int8"  # the shipped transformer: MiniLM quantised to int8
MODEL_DIR_NAME = ONNX_MODEL_DIR_NAME  # the default document model; its manifest names its query side
STATIC_MODEL_DIR_NAME = "minilm-static"  # a static model distilled from MiniLM (scripts/distill_static.py)
# Query-side names that were renamed: the int8 copy was a query side before it became the default model, and
# the static query side fitted to LoCoMo gave way to the static model distilled from generic English.
QUERY_MODEL_ALIASES = {"all-MiniLM-L6-v2-int8-query": "all-MiniLM-L6-v2-int8", "minilm-static-query": "minilm-static"}
MODEL_FILES = ("manifest.json", "model.onnx", "tokenizer.json", "tokenizer_config.json")
STATIC_FILES = ("manifest.json", "vectors.npy", "tokenizer.json")
EXPORT_HINT = "produce it with scripts/export_minilm.py or scripts/distill_static.py, or set embedder.model_path"


def default_model_dirs(name: str = MODEL_DIR_NAME) -> list[Path]:
    """Where a shipped model (``models/<name>``) is looked for: inside the installed package (``proxy/models``,
    package data of the wheel), beside the package (a checkout or editable install), then the cwd. Every model
    lookup goes through here."""
    packaged = _PACKAGE_DIR / "models" / name
    return [
        *([packaged] if packaged.is_dir() else []),
        Path(__file__).resolve().parents[3] / "models" / name,
        Path.cwd() / "models" / name,
    ]


def resolve_model_dir(model_path: Path | None) -> Path:
    """The model directory to load, checked to hold every file the local embedder needs (an ONNX export's, or
    a static model's)."""
    candidates = [model_path] if model_path is not None else default_model_dirs()
    for candidate in candidates:
        if is_static_model(candidate) or all((candidate / name).is_file() for name in MODEL_FILES):
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise EmbedderError(
        f"no embedding model found (tried {tried}); a model directory needs {', '.join(MODEL_FILES)} "
        f"(an ONNX export) or {', '.join(STATIC_FILES)} (a static model): {EXPORT_HINT}"
    )


def is_static_model(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a static model (a table of token vectors; ``scripts/distill_static.py``)."""
    return all((model_dir / name).is_file() for name in STATIC_FILES)


class ModelManifest(BaseModel):
    """``manifest.json`` of an exported model directory: what the vectors are and how big."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_id: str
    fastembed_model: str
    variant: str
    dim: int = Field(ge=1)
    space: str | None = None  # the model whose vector space this one writes into (a quantised copy); None = its own
    per_text: bool = False  # embed each text alone: its vector would depend on its batch (dynamic quantisation)
    query_side: str | None = None  # the query model ``embedder.query_model = "auto"`` picks; None = the model itself


def read_manifest(model_dir: Path) -> ModelManifest:
    """Parse the manifest, turning a broken one into an ``EmbedderError``."""
    return _parse_manifest(model_dir, ModelManifest, EXPORT_HINT)


def _parse_manifest(model_dir: Path, kind: type[_Manifest], hint: str) -> _Manifest:
    path = model_dir / "manifest.json"
    try:
        return kind.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise EmbedderError(f"unreadable model manifest {path}: {exc}; {hint}") from exc


class QueryManifest(BaseModel):
    """``manifest.json`` of a query-side model: its kind and the document space (``model_id``) it serves."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_id: str
    kind: Literal["static", "onnx"]
    query_for: str
    dim: int = Field(ge=1)


def resolve_query_model_dir(name: str) -> Path:
    """A query-side model: ``models/<name>`` as every model is looked up, or a directory path."""
    path = Path(name)
    candidates = [path] if len(path.parts) > 1 else default_model_dirs(QUERY_MODEL_ALIASES.get(name, name))
    for candidate in candidates:
        if (candidate / "manifest.json").is_file() and (candidate / "tokenizer.json").is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise EmbedderError(f"no query model {name!r} found (tried {tried}); {QUERY_HINT}")


QUERY_HINT = "build it with scripts/distill_static.py or scripts/quantize_query.py, or set embedder.query_model to none"


def read_query_manifest(model_dir: Path) -> QueryManifest:
    """Parse a query-side model's manifest, turning a broken one into an ``EmbedderError``."""
    return _parse_manifest(model_dir, QueryManifest, QUERY_HINT)
