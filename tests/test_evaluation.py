"""`memproxy eval --data FILE`: the retrieval benchmark on a file in LoCoMo's layout with the current configuration."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.evaluation import question_metrics
from tests.support.processes import MEMPROXY, child_env

SESSION_1 = [
    ("Ana", "I adopted a grey cat called Tofu last weekend."),
    ("Ben", "Lovely! How is Tofu settling in?"),
    ("Ana", "Great, although she hides under the sofa."),
    ("Ben", "I started pottery classes on Tuesdays."),
    ("Ana", "Pottery sounds relaxing, send me photos."),
]
SESSION_2 = [
    ("Ben", "My pottery teacher says my bowls are getting better."),
    ("Ana", "I am moving to Porto in June."),
    ("Ben", "Porto! Will you take Tofu with you?"),
    ("Ana", "Of course, the cat comes with me."),
]


def _sample() -> dict[str, Any]:
    def session(n: int, turns: list[tuple[str, str]]) -> list[dict[str, str]]:
        return [{"speaker": who, "dia_id": f"D{n}:{i + 1}", "text": text} for i, (who, text) in enumerate(turns)]

    return {
        "sample_id": "mini",
        "conversation": {
            "speaker_a": "Ana",
            "speaker_b": "Ben",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": session(1, SESSION_1),
            "session_2_date_time": "10:04 am on 20 May, 2023",
            "session_2": session(2, SESSION_2),
        },
        "qa": [
            {"question": "What is the name of Ana's cat?", "answer": "Tofu", "evidence": ["D1:1"], "category": 4},
            {"question": "Where is Ana moving?", "answer": "Porto", "evidence": ["D2:2"], "category": 4},
            {"question": "What class does Ben take?", "answer": "pottery", "evidence": ["D1:4", "D2:1"], "category": 1},
            {"question": "An adversarial one", "answer": "", "evidence": ["D1:2"], "category": 5},
        ],
    }


def _eval(data: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MEMPROXY), "eval", "--data", str(data), "--json"],
        capture_output=True,
        text=True,
        env=child_env(MEMPROXY_STORAGE__PATH=str(tmp_path / "untouched")),
        timeout=300,
        check=False,
    )


def test_question_metrics() -> None:
    """Recall, hits, all@10 and reciprocal rank follow the evidence's positions in the ranking."""
    metrics = question_metrics(["D1:3", "D1:1", "D2:5"], ["D1:1", "D9:9"])
    assert metrics["evidence_recall@10"] == 0.5
    assert (metrics["hit@1"], metrics["hit@5"], metrics["all@10"]) == (0.0, 1.0, 0.0)
    assert metrics["mrr"] == pytest.approx(0.5)


def test_eval_scores_a_locomo_layout_file(tmp_path: Path) -> None:
    """Category 1-4 questions are scored with the current configuration; the data directory is not used."""
    data = tmp_path / "mini.json"
    data.write_text(json.dumps([_sample()]))
    result = _eval(data, tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["questions"] == 3
    assert set(report["by_category"]) == {"single-hop", "multi-hop"}
    assert report["overall"]["hit@10"] == 1.0  # nine turns: every evidence turn is in the top ten
    assert report["by_category"]["single-hop"]["hit@5"] == 1.0
    assert not (tmp_path / "untouched").exists()


def test_eval_names_what_is_wrong_with_the_file(tmp_path: Path) -> None:
    """A file not in LoCoMo's layout exits 2 naming the sample."""
    data = tmp_path / "bad.json"
    data.write_text(json.dumps([_sample(), {"sample_id": "broken", "qa": []}]))
    result = _eval(data, tmp_path)
    assert result.returncode == 2
    assert "sample 1: not in LoCoMo's layout" in result.stderr
