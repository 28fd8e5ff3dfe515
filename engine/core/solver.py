"""The flow ODE's Euler solver with classifier-free guidance, as the official ``solve_euler``
of every family: dx/dt = v(x, t) from noise at t=0 to the mel at t=1, v evaluated on a batch
of two rows (conditional, and with mu/spks/cond zeroed) and combined as (1+w)·v_cond − w·v_uncond.
A family's estimator is the vector field; how it is called (masks, caches) is the family's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

#: Called once per Euler step with (step index, x fed to the estimator (1, 80, T), flow time t
#: (0-d tensor), raw estimator output (rows, 80, T): row 0 conditional, row 1 unconditional).
StepCallback = Callable[[int, Tensor, Tensor, Tensor], None]

T_SCHEDULERS = ("cosine", "linear")


class FieldInputs(NamedTuple):
    """What the estimator reads beside x at one Euler step, one row per guidance row."""

    mu: Tensor  # (rows, 80, T)
    t: Tensor  # (rows,)
    spks: Tensor  # (rows, 80)
    cond: Tensor  # (rows, 80, T)
    time_biases: list[Tensor]  # the step's time-MLP outputs


#: A family's estimator at one Euler step: (step, x (rows, 80, T), inputs) → v (rows, 80, T).
VectorField = Callable[[int, Tensor, FieldInputs], Tensor]


class EulerGrid(NamedTuple):
    """The flow times the solver visits and the step after each (as the official solver)."""

    times: list[Tensor]
    steps: list[Tensor]


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


def solve_euler(
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
    step_callback: StepCallback | None = None,
) -> Tensor:
    """Integrate from noise z (1, 80, T) at t=0 to t=1; returns the mel (1, 80, T) float32.

    ``time_biases``: every step's time-MLP output from the stacked flow times, computed in one
    batch (one row per step; the guidance rows share t).
    """
    grid = euler_grid(n_timesteps, scheduler, mu.dtype)
    # The guidance batch: row 0 conditional, row 1 with mu/spks/cond zeroed (same x and t).
    # These inputs are the same at every step, so they are built once. Guidance off (cfg_rate
    # 0, a fast-path option) needs only the conditional row: half the work.
    rows = 1 if cfg_rate == 0 else 2
    mu_in = torch.cat([mu, torch.zeros_like(mu)])[:rows]  # (rows, 80, T)
    spks_in = torch.cat([spks, torch.zeros_like(spks)])[:rows]  # (rows, 80)
    cond_in = torch.cat([cond, torch.zeros_like(cond)])[:rows]  # (rows, 80, T)
    step_biases = time_biases(torch.stack(grid.times))
    x = z
    for k, (t, dt) in enumerate(zip(grid.times, grid.steps, strict=True)):
        x_in = torch.cat([x, x]) if rows == 2 else x  # (rows, 80, T)
        biases = [b[k : k + 1] for b in step_biases]
        dphi = field(k, x_in, FieldInputs(mu_in, t.expand(rows), spks_in, cond_in, biases))
        if step_callback is not None:
            step_callback(k, x, t, dphi)
        v = (1.0 + cfg_rate) * dphi[:1] - cfg_rate * dphi[1:] if rows == 2 else dphi
        x = x + dt * v
    return x.float()


class GuidedEulerCFM(nn.Module):
    """A family's conditional flow matching decoder (key ``decoder``): its ``estimator`` and
    time schedule, solved by :func:`solve_euler`; the family says how its estimator is called
    (:meth:`vector_field`)."""

    estimator: Any  # an nn.Module with ``time_biases(times)``
    t_scheduler: str

    def vector_field(self, n_timesteps: int, **options: Any) -> VectorField:
        """The estimator as the solver calls it, for a solve of ``n_timesteps`` steps."""
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
        step_callback: StepCallback | None = None,
        **field_options: Any,
    ) -> Tensor:
        """Integrate the frames z (1, 80, T) from t=0 to 1; returns the mel (1, 80, T) float32
        (``field_options``: the family's, for :meth:`vector_field`)."""
        return solve_euler(
            self.vector_field(n_timesteps, **field_options),
            self.estimator.time_biases,
            z,
            mu,
            spks,
            cond,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
            scheduler=self.t_scheduler,
            step_callback=step_callback,
        )
