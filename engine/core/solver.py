"""The flow ODE's solvers with classifier-free guidance: dx/dt = v(x, t) from noise at t=0 to
the mel at t=1, v evaluated on a batch of two rows (conditional, and with mu/spks/cond zeroed)
and combined as (1+w)·v_cond − w·v_uncond. A family's estimator is the vector field; how it is
called (masks, caches) is the family's.

``euler`` is the official ``solve_euler`` of every family, step for step. The others are
approximations for few steps on the same time grid (``docs/dev/flow-solver.md`` has their
measured deviations):

* ``ab2``: second-order Adams–Bashforth with variable steps. Each step evaluates the field once,
  as Euler, and extrapolates it with the previous step's field (the first step is Euler's): the
  same cost as Euler, an error ∝ h² instead of h.
* ``heun`` and ``midpoint``: second-order Runge–Kutta, two evaluations a step.

Every evaluation has its own index (:func:`evaluation_count` of them in a solve); a stateful
estimator (CosyVoice2's streamed chunks) keeps one state per index, and a multistep method needs
nothing beyond one solve: the fields it reuses are of the same frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

#: Called once per estimator evaluation with (evaluation index, x fed to the estimator
#: (1, 80, T), flow time t (0-d tensor), raw estimator output (rows, 80, T): row 0 conditional,
#: row 1 unconditional).
StepCallback = Callable[[int, Tensor, Tensor, Tensor], None]

T_SCHEDULERS = ("cosine", "linear")
EXACT_SOLVER = "euler"
#: Solver name → estimator evaluations per step.
SOLVERS = {"euler": 1, "ab2": 1, "heun": 2, "midpoint": 2}


class FieldInputs(NamedTuple):
    """What the estimator reads beside x at one evaluation, one row per guidance row."""

    mu: Tensor  # (rows, 80, T)
    t: Tensor  # (rows,)
    spks: Tensor  # (rows, 80)
    cond: Tensor  # (rows, 80, T)
    time_biases: list[Tensor]  # the evaluation's time-MLP outputs


#: A family's estimator at one evaluation: (index, x (rows, 80, T), inputs) → v (rows, 80, T).
VectorField = Callable[[int, Tensor, FieldInputs], Tensor]


class EulerGrid(NamedTuple):
    """The flow times the solver visits and the step after each (as the official solver)."""

    times: list[Tensor]
    steps: list[Tensor]


def check_solver(solver: str) -> str:
    if solver not in SOLVERS:
        raise ValueError(f"unknown flow solver {solver!r}; one of {', '.join(SOLVERS)}")
    return solver


def evaluation_count(solver: str, n_timesteps: int) -> int:
    """Estimator evaluations (each over every guidance row) in one solve."""
    return SOLVERS[check_solver(solver)] * n_timesteps


def euler_grid(n_timesteps: int, scheduler: str, dtype: torch.dtype = torch.float32) -> EulerGrid:
    """t_0 … t_{n−1} and dt_k; cosine: t_k = 1 − cos(π/2 · k/n).

    Time is advanced by accumulation (t += dt; dt = t_{k+1} − t), which can differ from the
    grid in the last float32 bit, as upstream.
    """
    if n_timesteps < 1:
        raise ValueError(f"n_timesteps must be at least 1, got {n_timesteps}")
    if scheduler not in T_SCHEDULERS:
        raise ValueError(f"unsupported t_scheduler {scheduler!r}")
    grid = torch.linspace(0, 1, n_timesteps + 1, dtype=dtype)
    if scheduler == "cosine":
        grid = 1 - torch.cos(grid * 0.5 * torch.pi)
    times, steps = [grid[0]], [grid[1] - grid[0]]
    for k in range(1, n_timesteps):
        times.append(times[-1] + steps[-1])
        steps.append(grid[k + 1] - times[-1])
    return EulerGrid(times, steps)


def evaluation_times(grid: EulerGrid, solver: str) -> list[Tensor]:
    """The flow time of every evaluation of a solve, in the order they run."""
    if solver == "heun":  # each step's start and end
        return [t for t, dt in zip(*grid, strict=True) for t in (t, t + dt)]
    if solver == "midpoint":  # each step's start and middle
        return [t for t, dt in zip(*grid, strict=True) for t in (t, t + 0.5 * dt)]
    return list(grid.times)


class _GuidedField:
    """The estimator with guidance: one call per evaluation, its rows combined into one v."""

    def __init__(
        self,
        field: VectorField,
        biases: list[Tensor],
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        cfg_rate: float,
        step_callback: StepCallback | None,
        guided_evaluations: int | None = None,
    ) -> None:
        # The guidance batch: row 0 conditional, row 1 with mu/spks/cond zeroed (same x and t).
        # These inputs are the same at every evaluation, so they are built once. Guidance off
        # (cfg_rate 0, a fast-path option) needs only the conditional row: half the work.
        rows = 1 if cfg_rate == 0 else 2
        self.mu = torch.cat([mu, torch.zeros_like(mu)])[:rows]  # (rows, 80, T)
        self.spks = torch.cat([spks, torch.zeros_like(spks)])[:rows]  # (rows, 80)
        self.cond = torch.cat([cond, torch.zeros_like(cond)])[:rows]  # (rows, 80, T)
        self.field, self.biases, self.cfg_rate = field, biases, cfg_rate
        self.guided = guided_evaluations  # evaluations from this index on run one row
        self.step_callback = step_callback
        self.index = 0  # the next evaluation's

    def __call__(self, x: Tensor, t: Tensor) -> Tensor:
        k, cfg_rate = self.index, self.cfg_rate
        self.index += 1
        rows = self.mu.shape[0] if self.guided is None or k < self.guided else 1
        x_in = torch.cat([x, x]) if rows == 2 else x  # (rows, 80, T)
        biases = [b[k : k + 1] for b in self.biases]
        at = FieldInputs(self.mu[:rows], t.expand(rows), self.spks[:rows], self.cond[:rows], biases)
        dphi = self.field(k, x_in, at)
        if self.step_callback is not None:
            self.step_callback(k, x, t, dphi)
        return (1.0 + cfg_rate) * dphi[:1] - cfg_rate * dphi[1:] if rows == 2 else dphi


def _euler(v: _GuidedField, x: Tensor, grid: EulerGrid) -> Tensor:
    for t, dt in zip(grid.times, grid.steps, strict=True):
        x = x + dt * v(x, t)
    return x


def _ab2(v: _GuidedField, x: Tensor, grid: EulerGrid) -> Tensor:
    """x += h·((1 + r/2)·v_k − r/2·v_{k−1}), r = h_k / h_{k−1}: the line through the last two
    fields integrated over the step (Euler for the first)."""
    previous: tuple[Tensor, Tensor] | None = None  # (v_{k−1}, h_{k−1})
    for t, dt in zip(grid.times, grid.steps, strict=True):
        field = v(x, t)
        if previous is None:
            x = x + dt * field
        else:
            half_ratio = 0.5 * dt / previous[1]
            x = x + dt * ((1 + half_ratio) * field - half_ratio * previous[0])
        previous = (field, dt)
    return x


def _heun(v: _GuidedField, x: Tensor, grid: EulerGrid) -> Tensor:
    for t, dt in zip(grid.times, grid.steps, strict=True):
        start = v(x, t)
        end = v(x + dt * start, t + dt)
        x = x + 0.5 * dt * (start + end)
    return x


def _midpoint(v: _GuidedField, x: Tensor, grid: EulerGrid) -> Tensor:
    for t, dt in zip(grid.times, grid.steps, strict=True):
        half = 0.5 * dt
        x = x + dt * v(x + half * v(x, t), t + half)
    return x


_METHODS = {"euler": _euler, "ab2": _ab2, "heun": _heun, "midpoint": _midpoint}


def solve_flow(
    field: VectorField,
    time_biases: Callable[[Tensor], list[Tensor]],
    z: Tensor,
    mu: Tensor,
    spks: Tensor,
    cond: Tensor,
    *,
    n_timesteps: int,
    cfg_rate: float,
    scheduler: str,
    solver: str = EXACT_SOLVER,
    step_callback: StepCallback | None = None,
    guided_evaluations: int | None = None,
) -> Tensor:
    """Integrate from noise z (1, 80, T) at t=0 to t=1; returns the mel (1, 80, T) float32.

    ``time_biases``: every evaluation's time-MLP output from the stacked flow times, computed
    in one batch (one row per evaluation; the guidance rows share t). ``guided_evaluations``:
    only the first so many evaluations run guidance (None: all).
    """
    method = _METHODS[check_solver(solver)]
    grid = euler_grid(n_timesteps, scheduler, mu.dtype)
    biases = time_biases(torch.stack(evaluation_times(grid, solver)))
    v = _GuidedField(field, biases, mu, spks, cond, cfg_rate, step_callback, guided_evaluations)
    return method(v, z, grid).float()


class GuidedCFM(nn.Module):
    """A family's conditional flow matching decoder (key ``decoder``): its ``estimator`` and
    time schedule, solved by :func:`solve_flow`; the family says how its estimator is called
    (:meth:`vector_field`)."""

    estimator: Any  # an nn.Module with ``time_biases(times)``
    t_scheduler: str

    def vector_field(self, evaluations: int, **options: Any) -> VectorField:
        """The estimator as the solver calls it, for a solve of ``evaluations`` evaluations."""
        raise NotImplementedError

    def solve(
        self,
        z: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        *,
        n_timesteps: int,
        cfg_rate: float,
        solver: str = EXACT_SOLVER,
        step_callback: StepCallback | None = None,
        guided_evaluations: int | None = None,
        **field_options: Any,
    ) -> Tensor:
        """Integrate the frames z (1, 80, T) from t=0 to 1; returns the mel (1, 80, T) float32
        (``field_options``: the family's, for :meth:`vector_field`)."""
        if n_timesteps < 1:
            raise ValueError(f"n_timesteps must be at least 1, got {n_timesteps}")
        return solve_flow(
            self.vector_field(evaluation_count(solver, n_timesteps), **field_options),
            self.estimator.time_biases,
            z,
            mu,
            spks,
            cond,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
            scheduler=self.t_scheduler,
            solver=solver,
            step_callback=step_callback,
            guided_evaluations=guided_evaluations,
        )
