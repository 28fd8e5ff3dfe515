"""The flow's solvers against the exact solve: mel deviation versus estimator work.

    python -m engine.bench.flow_solvers --synthetic 300m        # full-size v1, random weights
    python -m engine.bench.flow_solvers --synthetic cosyvoice2  # full-size CosyVoice2
    python -m engine.bench.flow_solvers --synthetic cosyvoice3  # full-size CosyVoice3 (DiT)
    python -m engine.bench.flow_solvers --model-dir DIR [--json]

For each setting (solver, ODE steps, guidance, time schedule) it prints the estimator's row
evaluations per mel frame (an evaluation over both guidance rows counts two) and the relative L2
distance of the mel from the exact solve's (Euler, 10 steps on the cosine grid, guidance 0.7):
same tokens, speaker and noise. CosyVoice2 and CosyVoice3 are measured twice: one call over the
whole utterance, and streamed chunk by chunk as the server runs it (its estimator state carried
per evaluation; each compared with the exact solve on the same path).

``--bf16``: the flow with its estimator's Linear layers in bfloat16 (engine.core.bf16_flow), at
the exact and the fast profiles' settings, against the float32 flow's exact solve.

Random weights make a velocity field unlike a trained one: the figures rank the solvers on this
field, not on speech. Only the flow is loaded (float32, from the official checkpoint).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.bench.deviation import EXACT_CFG, EXACT_STEPS
from engine.core.solver import EXACT_SOLVER, SOLVERS

if TYPE_CHECKING:
    from engine.cosyvoice1.flow import FlowModel
    from engine.cosyvoice2.flow import ChunkCausalFlow

SEED = 0
SPEAKER_EMBED_DIM = 192


@dataclass(frozen=True)
class SolverSetting:
    """One way to solve the flow ODE."""

    solver: str
    n_timesteps: int
    cfg_rate: float
    scheduler: str = "cosine"
    guided_evaluations: int | None = None  # only the first so many run guidance (None: all)

    @property
    def evaluations(self) -> int:
        return SOLVERS[self.solver] * self.n_timesteps

    @property
    def rows_per_frame(self) -> int:
        """Estimator row evaluations per mel frame."""
        if self.cfg_rate == 0:
            return self.evaluations
        guided = self.evaluations if self.guided_evaluations is None else self.guided_evaluations
        return self.evaluations + min(guided, self.evaluations)

    @property
    def streamable(self) -> bool:
        """What a stream's settings can say (the server's profile)."""
        return self.scheduler == "cosine" and self.guided_evaluations is None

    def label(self) -> str:
        guidance = "off" if self.cfg_rate == 0 else f"{self.cfg_rate:g}"
        if self.cfg_rate and self.guided_evaluations is not None:
            guidance += f" (first {self.guided_evaluations})"
        return f"{self.solver} {self.n_timesteps} steps, guidance {guidance}, {self.scheduler}"


EXACT = SolverSetting(EXACT_SOLVER, EXACT_STEPS, EXACT_CFG)
# The ODE's own solution, near enough: how far the exact solve itself is from it says how much
# of a setting's deviation is the exact solve's discretisation, not the setting's.
CONVERGED = SolverSetting("heun", 16, EXACT_CFG)


#: The bfloat16 flow's settings beside the exact one: the fast profiles'.
BF16_SETTINGS = [
    SolverSetting("euler", 5, EXACT_CFG),
    SolverSetting("euler", 4, 0.0),
    SolverSetting("euler", 2, EXACT_CFG),
]


def candidates(few: bool = False) -> list[SolverSetting]:
    """The settings the table compares (today's fast profiles among them: Euler 5 steps with
    guidance, Euler 4 without); ``few``: only those around the fast profiles' work."""
    if few:
        off = [("euler", 2), ("euler", 3), ("euler", 4), ("ab2", 3), ("ab2", 4), ("heun", 2)]
        guided = [("euler", 2), ("ab2", 2), ("heun", 1), ("midpoint", 1), ("euler", 3),
                  ("euler", 4), ("euler", 5), ("ab2", 4), ("ab2", 5), ("heun", 2)]  # fmt: skip
        return [
            *(SolverSetting(solver, n, 0.0) for solver, n in off),
            *(SolverSetting(solver, n, EXACT_CFG) for solver, n in guided),
            SolverSetting("euler", 4, EXACT_CFG, guided_evaluations=2),
        ]
    out = []
    for solver, steps in (("euler", (2, 3, 4, 5, 6, 8)), ("ab2", (2, 3, 4, 5, 6, 8))):
        for n in steps:
            out.append(SolverSetting(solver, n, 0.0))
        for n in steps[:4]:
            out.append(SolverSetting(solver, n, EXACT_CFG))
    for solver in ("heun", "midpoint"):
        for n in (2, 3):
            out += [SolverSetting(solver, n, 0.0), SolverSetting(solver, n, EXACT_CFG)]
    for solver, n in (("euler", 4), ("ab2", 4), ("euler", 5), ("ab2", 5)):
        out.append(SolverSetting(solver, n, 0.0, scheduler="linear"))
        out.append(SolverSetting(solver, n, EXACT_CFG, guided_evaluations=n // 2))
    return out


@dataclass
class Row:
    path: str  # "whole" or "streamed"
    setting: str
    solver: str
    n_timesteps: int
    cfg_rate: float
    scheduler: str
    guided_evaluations: int | None
    rows_per_frame: int
    mel_rel_l2: float  # from the exact solve's mel
    ode_rel_l2: float  # from the converged solve's mel (NaN: not measured)


Solve = Callable[[SolverSetting], torch.Tensor]


def _embedding() -> torch.Tensor:
    return torch.randn(1, SPEAKER_EMBED_DIM, generator=torch.Generator().manual_seed(SEED + 1))


def _with_scheduler(decoder: Any, setting: SolverSetting, run: Callable[[], torch.Tensor]) -> Any:
    before = decoder.t_scheduler
    decoder.t_scheduler = setting.scheduler
    try:
        return run()
    finally:
        decoder.t_scheduler = before


def v1_solve(flow: FlowModel, n_tokens: int) -> Solve:
    """The v1 flow's mel of random tokens (encoded once), for a setting."""
    from engine.core.constants import N_MELS, SPEECH_VOCAB, tokens_to_frames

    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, SPEECH_VOCAB, (1, n_tokens), generator=gen)
    z = torch.randn(1, N_MELS, tokens_to_frames(n_tokens), generator=gen)
    empty = torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, N_MELS)
    with torch.inference_mode():
        c = flow.encode(tokens, *empty, _embedding())

    def solve(setting: SolverSetting) -> torch.Tensor:
        def run() -> torch.Tensor:
            return flow.decoder.solve(
                z.clone(),
                c.mu,
                c.spks,
                c.cond,
                n_timesteps=setting.n_timesteps,
                cfg_rate=setting.cfg_rate,
                solver=setting.solver,
                guided_evaluations=setting.guided_evaluations,
            )

        with torch.inference_mode():
            return _with_scheduler(flow.decoder, setting, run)

    return solve


def _v2_tokens(flow: ChunkCausalFlow, n_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, flow.args.vocab_size, (1, n_tokens), generator=gen)


def v2_whole_solve(flow: ChunkCausalFlow, n_tokens: int) -> Solve:
    """CosyVoice2's (or CosyVoice3's) mel of random tokens in one full-attention call, for a
    setting."""
    with torch.inference_mode():
        mu = flow.encode(_v2_tokens(flow, n_tokens), None, streaming=False)
        spks = flow.speaker(_embedding())
    z = flow.decoder.noise(0, mu.shape[2]).to(mu)
    cond = torch.zeros_like(mu)

    def solve(setting: SolverSetting) -> torch.Tensor:
        def run() -> torch.Tensor:
            return flow.decoder.solve(
                z,
                mu,
                spks,
                cond,
                n_timesteps=setting.n_timesteps,
                cfg_rate=setting.cfg_rate,
                solver=setting.solver,
                guided_evaluations=setting.guided_evaluations,
                streaming=False,
            )

        with torch.inference_mode():
            return _with_scheduler(flow.decoder, setting, run)

    return solve


def v2_streamed_solve(flow: ChunkCausalFlow, n_tokens: int) -> Solve:
    """CosyVoice2's (or CosyVoice3's) mel of random tokens streamed on the official hops (no
    prompt)."""
    from engine.cosyvoice2.streaming import official_hops

    tokens = _v2_tokens(flow, n_tokens).reshape(-1).tolist()
    lookahead = flow.args.pre_lookahead_len

    def chunks() -> Iterator[tuple[list[int], bool]]:
        hops, sent, covered = official_hops(0), 0, 0
        hop = next(hops)
        while covered + hop + lookahead <= len(tokens):
            end = covered + hop + lookahead
            yield tokens[sent:end], False
            sent, covered, hop = end, covered + hop, next(hops)
        yield tokens[sent:], True

    def solve(setting: SolverSetting) -> torch.Tensor:
        stream = flow.stream(
            torch.zeros(1, 0, dtype=torch.int64),
            torch.zeros(1, 0, flow.args.output_size),
            _embedding(),
            n_timesteps=setting.n_timesteps,
            cfg_rate=setting.cfg_rate,
            solver=setting.solver,
        )
        return torch.cat([stream.push(part, finalize=end) for part, end in chunks()], dim=2)

    return solve


def measure(
    path: str, solve: Solve, settings: list[SolverSetting], reference: Solve | None = None
) -> list[Row]:
    """Each setting's deviation from the exact and the converged solves on the same path
    (``reference``: solved by it, e.g. the float32 flow for a bfloat16 one)."""
    # A bfloat16 flow's deviation is from the float32 exact solve; its ODE error is not asked.
    exact = (reference or solve)(EXACT)
    converged = None if reference is not None else solve(CONVERGED)

    def distance(mel: torch.Tensor, reference: torch.Tensor) -> float:
        return float((mel - reference).norm() / reference.norm())

    rows = []
    for setting in [EXACT, *settings]:
        mel = solve(setting)
        deviation = distance(mel, exact)
        ode = math.nan if converged is None else distance(mel, converged)
        fields = {k: v for k, v in asdict(setting).items() if k in Row.__dataclass_fields__}
        rows.append(Row(path, setting.label(), rows_per_frame=setting.rows_per_frame,
                        mel_rel_l2=deviation, ode_rel_l2=ode, **fields))  # fmt: skip
        print(f"  {path:13} {setting.label():55} {deviation:.4f} {ode:.4f}", file=sys.stderr,
              flush=True)  # fmt: skip
    return rows


def run(
    model_dir: Path, n_tokens: int, *, streamed: bool = True, bf16: bool = False, few: bool = False
) -> list[Row]:
    """Every candidate on the flow of ``model_dir`` (v1, CosyVoice2 or CosyVoice3); with
    ``bf16`` also the bfloat16 flow (engine.core.bf16_flow) at a few settings against the
    float32 exact solve."""
    from engine.core.bf16_flow import use_bf16_linears
    from engine.family import model_family

    paths: list[tuple[str, Callable[[Any], Solve], list[SolverSetting]]]
    settings = candidates(few)
    family = model_family(model_dir).name
    if family in ("cosyvoice2", "cosyvoice3"):
        if family == "cosyvoice2":
            from engine.cosyvoice2 import model_dir as v2_dir
        else:
            from engine.cosyvoice3 import model_dir as v2_dir  # type: ignore[no-redef]

        flow = v2_dir.read_part(model_dir, v2_dir.read_args(model_dir), "flow")
        paths = [("whole", lambda f: v2_whole_solve(f, n_tokens), settings)]
        if streamed:
            stream_settings = [s for s in settings if s.streamable]
            paths.append(("streamed", lambda f: v2_streamed_solve(f, n_tokens), stream_settings))
    else:
        from engine.cosyvoice1 import model_dir as v1_dir

        flow = v1_dir.read_part(model_dir, v1_dir.read_model_args(model_dir), "flow")
        paths = [("whole", lambda f: v1_solve(f, n_tokens), settings)]
    rows = []
    for path, solve_with, path_settings in paths:
        exact_solve = solve_with(flow)
        if not bf16:
            rows += measure(path, exact_solve, path_settings)
            continue
        bf16_solve = solve_with(use_bf16_linears(copy.deepcopy(flow)))
        rows += measure(f"{path} bf16", bf16_solve, BF16_SETTINGS, reference=exact_solve)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [f"{'path':13}  {'rows/frame':>10}  {'vs exact':>8}  {'vs ODE':>8}  setting"]
    for row in sorted(rows, key=lambda r: (r.path, r.rows_per_frame, r.mel_rel_l2)):
        lines.append(
            f"{row.path:13}  {row.rows_per_frame:>10}  {row.mel_rel_l2:>8.4f}  "
            f"{row.ode_rel_l2:>8.4f}  {row.setting}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.flow_solvers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--synthetic", choices=("300m", "cosyvoice2", "cosyvoice3"))
    model.add_argument("--model-dir", type=Path)
    parser.add_argument("--tokens", type=int, default=100, help="speech tokens (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-streamed", action="store_true", help="CosyVoice2: whole only")
    parser.add_argument("--few", action="store_true", help="the settings near the fast profiles")
    parser.add_argument(
        "--bf16", action="store_true", help="the bfloat16 flow instead of the solvers"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from engine.bench import synthetic

        build = {
            "300m": synthetic.ensure_synthetic_model,
            "cosyvoice2": synthetic.ensure_synthetic_cosyvoice2,
            "cosyvoice3": synthetic.ensure_synthetic_cosyvoice3,
        }[args.synthetic]
        model_dir = build()
    rows = run(model_dir, args.tokens, streamed=not args.no_streamed, bf16=args.bf16, few=args.few)
    if args.json:
        print(json.dumps({"model_dir": str(model_dir), "rows": [asdict(r) for r in rows]}))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
