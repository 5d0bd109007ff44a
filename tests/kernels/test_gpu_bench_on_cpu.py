"""The GPU benchmark of ``make gpu-check`` runs end to end on the stand-in cupy.

It only ever runs for real on a lent GPU machine, once; this keeps every section
of it (our kernels, the served path on ``--device cuda``, the report) runnable
in CI, so that run is not spent on a typo. No timing is asserted.
"""

from __future__ import annotations

import json
import sys

from tests.benchmarks import bench_lstm_gpu
from tests.kernels import fake_cupy, shim_backend


def test_every_section_runs_and_is_reported(tmp_path, monkeypatch, capsys):
    lib = shim_backend.build(tmp_path)
    monkeypatch.setattr(bench_lstm_gpu, "SIZES", [(4, 3, 5), (3, 2, 4)])
    report = tmp_path / "bench.json"
    monkeypatch.setattr("sys.argv", ["bench_lstm_gpu", "--json", str(report)])
    monkeypatch.setitem(sys.modules, "torch", None)  # no cuDNN section, even on a GPU machine
    with fake_cupy.installed(lib):
        bench_lstm_gpu.main()
    rows = json.loads(report.read_text())["sizes"]
    assert [(r["T"], r["B"], r["H"]) for r in rows] == [(4, 3, 5), (3, 2, 4)]
    for row in rows:
        assert not [k for k in row if k.endswith("_error")], row
        for key in (
            "ours_fwd_ms",
            "ours_bwd_enqueue_ms",
            "graphs_bwd_ms",
            "served_bwd_ms",
            "served_graphs_bwd_ms",
            "inproc_bwd_ms",
        ):
            assert row[key] > 0, key
    printed = capsys.readouterr().out
    assert "ours  fwd" in printed and "ours, --cuda-graphs on" in printed
    assert "served, eager (resident" in printed and "served, --cuda-graphs on (resident" in printed
