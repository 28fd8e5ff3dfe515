"""The flow ODE's solvers: Euler as the official steps, the others' order of convergence measured
on an ODE with a known solution, and the guidance rows combined at every evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DATA
from torch import Tensor

from engine.core.solver import (
    SOLVERS,
    FieldInputs,
    euler_grid,
    evaluation_count,
    evaluation_times,
    solve_flow,
)

X0 = torch.linspace(0.2, 1.5, 12, dtype=torch.float64).reshape(1, 1, 12)


def rate(t: Tensor) -> Tensor:
    return 1 + 2 * t


def exact_end(x0: Tensor) -> Tensor:
    """dx/dt = −(1 + 2t)·x²  ⇒  1/x(1) = 1/x0 + ∫₀¹(1 + 2t) dt = 1/x0 + 2."""
    return x0 / (1 + 2 * x0)


def analytic_field(seen: list[float]) -> object:
    def field(k: int, x: Tensor, at: FieldInputs) -> Tensor:
        # The time biases are the evaluation's own flow time (see time_biases below).
        torch.testing.assert_close(at.time_biases[0].reshape(-1), at.t[:1], rtol=0, atol=0)
        seen.append(float(at.t[0]))
        return -rate(at.t).reshape(-1, 1, 1) * x * x

    return field


def solve_analytic(solver: str, n: int, scheduler: str, seen: list[float] | None = None) -> Tensor:
    zeros = torch.zeros_like(X0)
    return solve_flow(
        analytic_field([] if seen is None else seen),  # type: ignore[arg-type]
        lambda times: [times.reshape(-1, 1)],
        X0.clone(),
        zeros,
        torch.zeros(1, 1, dtype=torch.float64),
        zeros,
        n_timesteps=n,
        cfg_rate=0.0,
        scheduler=scheduler,
        solver=solver,
    ).double()


def observed_order(solver: str, scheduler: str) -> float:
    """log2 of the error ratio between n and 2n steps, at n = 16 and 32."""
    errors = [
        float((solve_analytic(solver, n, scheduler) - exact_end(X0)).abs().max()) for n in (16, 32)
    ]
    return math.log2(errors[0] / errors[1])


@pytest.mark.parametrize("scheduler", ["linear", "cosine"])
@pytest.mark.parametrize(("solver", "order"), [("euler", 1), ("ab2", 2), ("heun", 2),
                                               ("midpoint", 2)])  # fmt: skip
def test_order_of_convergence(solver: str, order: int, scheduler: str) -> None:
    # The cosine grid's steps vary (smoothly), which a variable-step method keeps at its order.
    assert abs(observed_order(solver, scheduler) - order) < 0.15


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_each_evaluation_runs_at_its_listed_time(solver: str) -> None:
    seen: list[float] = []
    solve_analytic(solver, 4, "cosine", seen)
    assert len(seen) == evaluation_count(solver, 4)
    grid = euler_grid(4, "cosine", torch.float64)
    assert seen == [float(t) for t in evaluation_times(grid, solver)]


def test_second_order_beats_euler_at_the_same_evaluations() -> None:
    """On a smooth field: AB2 with as many evaluations as Euler, and Heun with half the steps."""
    truth = exact_end(X0)

    def error(solver: str, n: int) -> float:
        return float((solve_analytic(solver, n, "cosine") - truth).abs().max())

    assert error("ab2", 4) < error("euler", 4) / 2
    assert error("heun", 2) < error("euler", 4)


def test_euler_is_the_official_step_order_bit_for_bit() -> None:
    """Euler with guidance: x += dt·((1+w)·v_cond − w·v_uncond) at the accumulated times, the
    time MLP's output of each step fed to its evaluation (the exact profiles' maths)."""
    gen = torch.Generator().manual_seed(0)
    z, mu, cond = (torch.randn(1, 80, 30, generator=gen) for _ in range(3))
    spks = torch.randn(1, 80, generator=gen)
    weight = torch.randn(80, 80, generator=gen) / 9

    def field(k: int, x: Tensor, at: FieldInputs) -> Tensor:
        h = x + at.mu + at.cond + at.spks.unsqueeze(-1) + at.time_biases[0].unsqueeze(-1)
        return torch.tanh(torch.einsum("oc,bct->bot", weight, h)) * at.t.reshape(-1, 1, 1)

    def biases(times: Tensor) -> list[Tensor]:
        return [torch.sin(times).unsqueeze(1).expand(-1, 80) * 0.3]

    got = solve_flow(field, biases, z, mu, spks, cond, n_timesteps=7, cfg_rate=0.7,
                     scheduler="cosine")  # fmt: skip
    grid = euler_grid(7, "cosine")
    step_biases = biases(torch.stack(grid.times))[0]
    rows = (torch.cat([mu, 0 * mu]), torch.cat([spks, 0 * spks]), torch.cat([cond, 0 * cond]))
    x = z
    for k, (t, dt) in enumerate(zip(grid.times, grid.steps, strict=True)):
        inputs = FieldInputs(rows[0], t.expand(2), rows[1], rows[2], [step_biases[k : k + 1]])
        dphi = field(k, torch.cat([x, x]), inputs)
        x = x + dt * ((1.0 + 0.7) * dphi[:1] - 0.7 * dphi[1:])
    assert torch.equal(got, x)


def test_guidance_on_the_first_evaluations_only() -> None:
    rows: list[int] = []

    def field(k: int, x: Tensor, at: FieldInputs) -> Tensor:
        rows.append(x.shape[0])
        assert at.mu.shape[0] == at.spks.shape[0] == at.cond.shape[0] == x.shape[0]
        return torch.ones_like(x)

    z = torch.zeros(1, 80, 5)
    solve_flow(field, lambda t: [t.reshape(-1, 1)], z, z, torch.zeros(1, 80), z, n_timesteps=4,
               cfg_rate=0.7, scheduler="cosine", solver="ab2", guided_evaluations=2)  # fmt: skip
    assert rows == [2, 2, 1, 1]


def test_an_unknown_solver_is_refused() -> None:
    from engine.core.types import InvalidOptionError, SynthesisOptions

    with pytest.raises(ValueError, match="unknown flow solver 'rk4'"):
        evaluation_count("rk4", 4)
    with pytest.raises(InvalidOptionError, match="unknown flow solver"):
        SynthesisOptions(solver="rk4")


# --- the setting, from a profile to the flow ---------------------------------------------------


def test_a_profile_names_its_solver() -> None:
    from wyoming_cosyvoice.config import ConfigError, load_config

    config = load_config(overrides=[("profiles.fast.solver", "heun")])
    assert (
        config.profiles["fast"]
        .options(speaker=None, seed=None, instruct=None, force_tokens=None)
        .solver
        == "heun"
    )
    # Every packaged profile runs the official Euler steps but faster, whose one Heun step
    # (two evaluations) sits between fast's five Euler steps and fastest's one.
    packaged = {name: profile.solver for name, profile in load_config().profiles.items()}
    assert packaged.pop("faster") == "heun"
    assert set(packaged.values()) == {"euler"}
    with pytest.raises(ConfigError, match=r"profiles.fast.solver"):
        load_config(overrides=[("profiles.fast.solver", "rk4")])


def test_the_request_solver_reaches_the_flow(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A v1 request with Heun at 2 steps runs the estimator 4 times per flow call, and the stage
    costs count 4 evaluations × 2 guidance rows per call."""
    from engine.core.stage_times import StageTime
    from engine.core.types import SynthesisOptions
    from engine.cosyvoice1.engine import CosyVoiceEngine

    engine = CosyVoiceEngine.load(DATA / "tiny_model", cache_dir=tmp_path / "cache")
    estimator = engine.flows["fp32"].decoder.estimator
    calls: list[int] = []
    handle = estimator.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    stages: list[StageTime] = []
    try:
        for solver in ("euler", "heun"):
            calls.clear()
            options = SynthesisOptions(
                speaker=engine.speakers[0], n_timesteps=2, solver=solver, force_tokens=30,
                seed=0, stream=False, on_stage=stages.append,
            )  # fmt: skip
            assert list(engine.synthesize("你好。", options))
            assert calls == [2] * evaluation_count(solver, 2)
    finally:
        handle.remove()
    flow_passes = [s.passes for s in stages if s.stage == "flow"]
    assert flow_passes == [4, 8]
