"""``perigee sim repro`` writes to a scratch folder unless --out is given, and says where
(issue 23: it overwrote the tracked docs/figures/ by default)."""

from perigee.sim import repro
from perigee.trace import DEFAULT_TRACE


def test_default_out_is_a_scratch_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert repro.main(["fig16", "--trace", str(DEFAULT_TRACE), "--limit", "100"]) == 0
    out = tmp_path / ".perigee" / "sim-repro"
    assert sorted(p.name for p in out.iterdir()) == ["sim_fig16.json", "sim_fig16.png"]
    assert f"writing to {out}/" in capsys.readouterr().out
    assert not (tmp_path / "docs").exists()


def test_out_is_honoured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert repro.main(["fig16", "--limit", "100", "--out", "figs"]) == 0
    assert (tmp_path / "figs" / "sim_fig16.json").exists()
