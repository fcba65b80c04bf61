"""tools/results_tables.py on the CPU: the docs' tables are printed from the saved result files."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import results_tables


def _pd_row(kv, length, prefill_ms, decode_ms):
    return {"nheads_kv": kv, "cache_len": length, "prefill_ms": prefill_ms, "prefill_tflops": 312.4 / prefill_ms,
            "decode_ms": decode_ms, "decode_tbps": 2.0}


def test_prefill_against_decode_rows_by_kv_heads_then_length():
    rows = [_pd_row(8, 8192, 1.25, 0.0176), _pd_row(32, 8192, 1.5, 0.05), _pd_row(8, 4096, 0.5, 0.0133)]
    table = results_tables.prefill_decode_table(rows)
    body = [line for line in table if line.startswith("| ") and not line.startswith("| kv")]
    assert [line.split(" | ")[:2] for line in body] == [["| 32", "8192"], ["| 8", "4096"], ["| 8", "8192"]]
    assert body[1] == "| 8 | 4096 | 0.50 | 625 | 13.3 | 2.00 |"  # decode in us
    assert results_tables.prefill_decode_table([]) == []


def test_the_saved_results_print(monkeypatch, capsys):
    """Every file in docs/results reads, and each operation's table is there: the docs quote them."""
    folder = Path(__file__).resolve().parents[1] / "docs" / "results"
    monkeypatch.setattr(sys, "argv", ["results_tables.py", str(folder)])
    results_tables.main()
    out = capsys.readouterr().out
    for title in ("**Forward** (bf16", "**Backward** (bf16", "**Decode**", "| kv heads | cache tokens", "**Variants**",
                  "**Varlen**", "**End to end: GPT training**"):
        assert title in out, title
