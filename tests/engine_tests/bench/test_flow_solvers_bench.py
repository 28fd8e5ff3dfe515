"""``python -m engine.bench.flow_solvers``: each family's flow solved at the candidate settings,
whole and (CosyVoice2, CosyVoice3) streamed, against its exact solve."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DATA

from engine.bench.flow_solvers import EXACT, SolverSetting, run

TINY = {
    "cosyvoice1": DATA / "tiny_model",
    "cosyvoice2": DATA / "cosyvoice2" / "tiny",
    "cosyvoice3": DATA / "cosyvoice3" / "tiny",
}
FEW = [SolverSetting("euler", 4, 0.0), SolverSetting("euler", 2, 0.7)]


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """No oversubscription of the shared cores."""


@pytest.mark.parametrize("family", TINY)
def test_each_family_is_measured_on_its_own_paths(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("engine.bench.flow_solvers.candidates", lambda few=False: FEW)
    rows = run(Path(TINY[family]), 30)
    paths = ["whole"] if family == "cosyvoice1" else ["whole", "streamed"]
    assert sorted({row.path for row in rows}) == sorted(paths)
    for path in paths:
        on_path = {row.setting: row for row in rows if row.path == path}
        assert list(on_path) == [EXACT.label(), *(s.label() for s in FEW)]
        assert on_path[EXACT.label()].mel_rel_l2 == 0
        assert all(0 < on_path[s.label()].mel_rel_l2 < 1 for s in FEW)
        assert [on_path[s.label()].rows_per_frame for s in FEW] == [4, 4]
