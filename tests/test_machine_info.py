"""What every benchmark JSON records of its machine: the CPU's family and model besides its brand
string, which on a cloud VM ("AMD EPYC") names no generation."""
from __future__ import annotations

from pathlib import Path

from kvtier.bench import common


def test_the_cpu_id_is_the_first_processors_family_and_model(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
                    "processor\t: 1\ncpu family\t: 99\nmodel\t\t: 99\n")
    real = Path

    def fake(p: str = "", *a):
        return info if p == "/proc/cpuinfo" else real(p, *a)

    monkeypatch.setattr(common, "Path", fake)
    assert common._cpu_id(common._cpuinfo()) == "family 25 model 17"
    info.write_text("processor\t: 0\nmodel name\t: some CPU\n")  # no family line (not x86): nothing made up
    assert common._cpu_id(common._cpuinfo()) is None
    assert common.machine_info()["cpu_id"] is None
