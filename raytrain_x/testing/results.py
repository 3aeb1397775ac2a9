"""Results as people read them and programs compare them: an aligned table on stdout and
a JSON file (the benchmarks and the chaos soak write both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Prints rows as an aligned text table.

    Args:
        rows: one dict per row.
        columns: the keys shown, in order (a missing one shows empty).
    """
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Writes `payload` to `path` (its folder made if needed) and returns the path.

    Args:
        path: the file to write.
        payload: JSON-serialisable results.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    return out
