"""The quickstart notebook runs top to bottom against the current API."""

import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its run dir lands in tmp_path/runs/notebook
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    for i, cell in enumerate(cells):
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[code cell {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "eval bits/byte" in out
    assert namespace["summary"].steps == 30
    assert namespace["out"].logits.shape == (2, 16, 259)
    assert (tmp_path / "runs" / "notebook" / "metrics.jsonl").is_file()
