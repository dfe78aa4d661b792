"""The comm term of the projection: dispatch and combine time of one MoE layer, an alpha-beta model per backend, link
and operation, fitted to the published series in data/comm.json (docs/projection.md).

    t(EP, bytes) = alpha + bytes / beta(EP)

alpha: the floor a call pays whatever it sends (launch, signalling), the intercept of a least-squares line through
the points of one EP size measured at several token counts; a series measured at one token count takes its
backend's alpha from a series that has one (said in `alpha_from`). beta(EP): the bandwidth each point implies once
alpha is paid, interpolated in log2(EP) between the measured sizes. A query outside the measured EP sizes takes the
nearest size's beta and is flagged, never extrapolated silently. A bandwidth table (DeepEP's normal kernels) gives
beta(EP) directly and its floor as the source states it (form "bandwidth")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources

from deepinfer.errors import DeepInferError

COMM_FILE = "comm.json"


@dataclass(frozen=True)
class Estimate:
    us: float
    flags: tuple[str, ...] = ()          # why the value is less than measured (outside the data, borrowed alpha)


@dataclass
class AlphaBeta:
    """One (backend, link, op) series fitted."""
    backend: str
    link: str
    op: str
    alpha_us: float
    beta: dict[int, float]               # EP size -> bytes per second after alpha
    alpha_from: str                      # "fit", "stated" (a bandwidth table) or the series whose alpha it takes
    residuals: list[float] = field(default_factory=list)     # (model - measured) / measured per point
    source: str = ""
    measured_on: str = ""                # the series' hardware as the data file names it

    def time(self, ep: int, nbytes: float) -> Estimate:
        sizes = sorted(self.beta)
        flags = [] if self.alpha_from == "fit" else \
            [f"alpha {self.alpha_us:g} us as the source states"] if self.alpha_from == "stated" else \
            [f"alpha from {self.alpha_from}"]
        if ep <= sizes[0] or ep >= sizes[-1]:
            near = sizes[0] if ep <= sizes[0] else sizes[-1]
            if ep != near:
                flags.append(f"EP {ep} outside the measured {sizes[0]}-{sizes[-1]}: EP {near}'s bandwidth")
            inv = 1 / self.beta[near]
        else:
            hi = next(s for s in sizes if s >= ep)
            lo = sizes[sizes.index(hi) - 1]
            w = (math.log2(ep) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            inv = (1 - w) / self.beta[lo] + w / self.beta[hi]
        return Estimate(self.alpha_us + nbytes * inv * 1e6, tuple(flags))


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs; the intercept clamped at 0 (a negative floor is noise)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise DeepInferError("a line needs points at two different sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return max(my - slope * mx, 0.0), slope


def _series_bytes(s: dict, tokens: int) -> float:
    return tokens * s["top_k"] * s["bytes_per_copy"]


def _own_alpha(s: dict) -> float | None:
    """The intercept of the EP size with the most token counts, if it has two or more."""
    by_ep: dict[int, list] = {}
    for ep, tokens, us in s["points"]:
        by_ep.setdefault(ep, []).append((_series_bytes(s, tokens), us))
    ep, pts = max(by_ep.items(), key=lambda kv: len({b for b, _ in kv[1]}))
    if len({b for b, _ in pts}) < 2:
        return None
    return line_fit([b for b, _ in pts], [u for _, u in pts])[0]


def fit(series: list[dict]) -> dict[tuple[str, str, str], AlphaBeta]:
    """(backend, link, op) -> its fitted AlphaBeta."""
    alphas = {(s["backend"], s["link"], s["op"]): _own_alpha(s) for s in series if s.get("form") != "bandwidth"}
    out = {}
    for s in series:
        key = (s["backend"], s["link"], s["op"])
        if s.get("form") == "bandwidth":         # a bandwidth table: beta as published, the floor as stated
            out[key] = AlphaBeta(*key, float(s["alpha_us"]), {ep: gbps * 1e9 for ep, _, gbps in s["points"]},
                                 "stated", [0.0] * len(s["points"]), s["source"], s.get("hardware", ""))
            continue
        alpha, came = alphas[key], "fit"
        if alpha is None:
            donors = [(k, a) for k, a in alphas.items() if k[0] == s["backend"] and a is not None]
            if not donors:
                raise DeepInferError(f"comm series {'/'.join(key)}: no token-count sweep gives its floor (alpha), "
                                     f"and no other {s['backend']} series has one; add points at two token counts")
            (dk, alpha), = donors[:1]
            came = "/".join(dk)
        beta: dict[int, list[float]] = {}
        for ep, tokens, us in s["points"]:
            if us <= alpha:
                raise DeepInferError(f"comm series {'/'.join(key)}: {us} us at EP {ep} is under its floor "
                                     f"{alpha:.1f} us")
            beta.setdefault(ep, []).append(_series_bytes(s, tokens) / ((us - alpha) * 1e-6))
        ab = AlphaBeta(*key, alpha, {ep: sum(v) / len(v) for ep, v in beta.items()}, came, source=s["source"],
                       measured_on=s.get("hardware", ""))
        ab.residuals = [ab.time(ep, _series_bytes(s, t)).us / us - 1 for ep, t, us in s["points"]]
        out[key] = ab
    return out


def load(path=None) -> dict:
    """The comm data (version, series): the packaged file, or `path`."""
    text = (resources.files(__package__) / "data" / COMM_FILE).read_text() if path is None else open(path).read()
    data = json.loads(text)
    for s in data["series"]:
        missing = {"backend", "link", "op", "hidden", "top_k", "bytes_per_copy", "points", "source"} - set(s)
        if missing:
            raise DeepInferError(f"{COMM_FILE}: a series lacks {sorted(missing)}")
    return data
