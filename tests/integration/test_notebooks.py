"""The example notebooks, run end to end by a real Jupyter kernel against the session's cluster."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "examples" / "notebooks"


def _run(name: str, cluster_address: str, tmp_path: Path, monkeypatch) -> str:
    """Executes the notebook in a fresh kernel; returns its text outputs joined. A cell that
    raises fails the test with the cell's traceback (nbclient's CellExecutionError)."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RAY_ADDRESS", cluster_address)  # the kernel joins the session cluster
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # see test_ray_train.py
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(notebook, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts, images = [], 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", output
            if output["output_type"] == "stream":
                texts.append(output["text"])
            elif "text/plain" in output.get("data", {}):
                texts.append(output["data"]["text/plain"])
            images += "image/png" in output.get("data", {})
    assert images == 1, "the notebook's plot is missing"
    return "".join(texts)


def _accuracy(text: str) -> float:
    found = re.search(r"test accuracy ([0-9.]+)", text)
    assert found, text
    return float(found.group(1))


@pytest.mark.timeout(300)
def test_the_ray_executor_notebook_runs(ray_cluster, tmp_path, monkeypatch):
    text = _run("ray_executor.ipynb", ray_cluster, tmp_path, monkeypatch)
    assert "epoch 8: mean loss" in text
    assert _accuracy(text) > 0.9 and "the same on both ranks: True" in text


@pytest.mark.timeout(300)
def test_the_ray_train_notebook_runs(ray_cluster, tmp_path, monkeypatch):
    text = _run("ray_train.ipynb", ray_cluster, tmp_path, monkeypatch)
    assert _accuracy(text) > 0.85 and "after 4 epochs" in text
    assert "checkpoint in the run's storage: True" in text
