"""The runner's speculative part, all on the device after the target forward: verify every verify row, then draft
the next block for every sampled row from the position its accepted prefix ends at.

Verification rules (engine/speculative/): greedy rows take the target argmax (exact); random rows use
  lossless  accept d with min(1, p_t(d) / p_d(d)), resample the residual at the first rejection, bonus from p_t
            (speculative/rejection.py); needs the draft distributions, kept per slot from the block that drew them
  coupled   batch-invariant mode: drafts draw with the target's own noise at their position, and a draft is
            accepted iff it equals the target's sample there, so the committed tokens are exactly those of
            non-speculative decoding whatever the verify lengths (which depend on the batch)
  pinned    benchmarks: acceptance from a pinned model (speculative/pinned.py); the kernels still run every real shape
The plain samples s_j (what one-at-a-time decoding draws at each slot) come from the sampler; the draft block of
row r anchors at its last accepted input position p = p0 - 1 + a with the committed token there."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.sampling import gumbel_argmax
from deepinfer.kernels.table import active

from ..sampling.sampler import SALT_DRAFT, SALT_TARGET, temperature_divisor
from ..speculative.config import SpeculativeConfig
from ..speculative.pinned import pinned_accepts, pinned_confidence
from ..speculative.rejection import verify as lossless_verify
from .graphs import capture


@dataclass
class Rows:
    """One step's sampled rows for verification and drafting (host lists -> device tensors once)."""
    offsets: torch.Tensor     # [R] each row's first logit row in the step's M rows
    drafts: torch.Tensor      # [R, L] the drafts each row fed (-1 padding), L = widest row
    lengths: torch.Tensor     # [R] drafts fed
    first: torch.Tensor       # [R] position of each row's first draft (p0; its first logit row samples p0)
    slots: torch.Tensor       # [R]
    seeds: torch.Tensor       # [R]
    temperature: torch.Tensor  # [R] float32 (0: greedy)
    random: bool              # any row samples (temperature > 0), known on the host
    width: int                # L

    @classmethod
    def of(cls, sampled, offsets: list[int], device) -> "Rows":
        """sampled: the step's sampled rows (scheduler/plan.ScheduledRow); offsets: each one's first logit row."""
        fed = [s.draft_ids for s in sampled]
        width = max((len(d) for d in fed), default=0)
        pad = [list(d) + [-1] * (width - len(d)) for d in fed]
        t = lambda v, dt=torch.long: torch.tensor(v, dtype=dt).to(device, non_blocking=True)   # noqa: E731
        temps = [s.params.temperature for s in sampled]
        return cls(t(offsets), t(pad).view(len(sampled), width), t([len(d) for d in fed]),
                   t([s.start + s.n - s.num_logits + 1 for s in sampled]), t([s.slot for s in sampled]),
                   t([s.seed for s in sampled]), t(temps, torch.float32), any(x > 0 for x in temps), width)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit row of every (row, slot) [R, L+1] (clamped to the row's own), live slots [R, L+1])."""
        j = torch.arange(self.width + 1, device=self.offsets.device).unsqueeze(0)
        live = j <= self.lengths.unsqueeze(1)
        return self.offsets.unsqueeze(1) + torch.minimum(j, self.lengths.unsqueeze(1)), live


class Speculator:
    def __init__(self, model, pools, config: SpeculativeConfig, invariant: bool, graph_sizes: list[int] | None = None):
        """graph_sizes: the padded row counts whose draft blocks are CUDA graphs (None: always eager)."""
        self.model, self.pools, self.config = model, pools, config
        self.gamma = config.num_speculative_tokens
        self.rule = "pinned" if config.acceptance is not None else "coupled" if invariant else "lossless"
        self.draft_logits: torch.Tensor | None = None    # [S+1, gamma, V] fp32: each slot's last draft distributions
        self.graphs = DraftGraphs(self, graph_sizes) if graph_sizes else None

    # ---- verification ----
    def verify(self, rows: Rows, x: torch.Tensor, noise_rows, plain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, V] processed target logits, plain [M] the plain samples -> (committed-token view [M]: row r's first
        accepted[r] + 1 entries are what it commits, accepted [R])."""
        at, live = rows.grid()                                                   # [R, L+1]
        if rows.width == 0:
            return plain, torch.zeros_like(rows.lengths)
        if self.rule == "lossless" and rows.random:
            if self.draft_logits is None:
                raise RuntimeError("internal: a sampled verify row without the draft distributions it drew from")
            greedy = rows.temperature <= 0
            accepted, toks = lossless_verify(x[at], rows.drafts, self.draft_logits[rows.slots, :rows.width],
                                             rows.lengths, greedy, rows.seeds, rows.first)
            j = torch.arange(rows.width + 1, device=x.device).unsqueeze(0)
            return _write(plain, at, rows.lengths, j <= accepted.unsqueeze(1), toks), accepted
        if self.rule == "pinned":
            accepted = pinned_accepts(self.config.acceptance, self.config.confidence_spread, rows.seeds, rows.first,
                                      rows.lengths, rows.width)
        else:                                  # greedy rows, and the coupled rule: accept while draft == sample
            same = (plain[at[:, :-1]] == rows.drafts) & live[:, 1:]
            accepted = same.long().cumprod(dim=1).sum(dim=1)
        j = torch.arange(rows.width + 1, device=x.device).unsqueeze(0)
        drafts = torch.cat([rows.drafts, rows.drafts[:, :1]], dim=1)
        return _write(plain, at, rows.lengths, j < accepted.unsqueeze(1), drafts), accepted

    # ---- drafting ----
    def draft(self, rows: Rows, committed: torch.Tensor, accepted: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next draft block of every row -> (drafts [R, gamma], confidences [R, gamma] in [0, 1]). Replayed
        from a CUDA graph of the padded row count when the runner has graphs (DraftGraphs), else eager."""
        anchor_pos = rows.first - 1 + accepted                                    # p: last accepted input position
        anchor = committed[rows.offsets + accepted]                               # the token committed for p + 1
        keep = self.rule == "lossless" and rows.random
        if keep and self.draft_logits is None:
            self.draft_logits = torch.zeros(self.pools.num_slots + 1, self.gamma, self.model.cfg.vocab_size,
                                            dtype=torch.float32, device=committed.device)
        return self.draft_block(rows.slots, anchor_pos, anchor, rows.seeds, rows.temperature, rows.random, keep)

    def draft_block(self, slots, anchor_pos, anchor, seeds, temperature, random: bool = False, keep: bool = False):
        """block(), replayed from a CUDA graph of the padded row count when there are graphs, else eager."""
        args = (slots, anchor_pos, anchor, seeds, temperature)
        if self.graphs is not None:
            out = self.graphs.run(args, random, keep)
            if out is not None:
                return out
        return self.block(*args, random, keep)

    def block(self, slots, anchor_pos, anchor, seeds, temperature, random: bool, keep: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft block per row from device tensors [R] (static shapes): slots, p, the token for p + 1, seeds,
        temperatures; random: some row samples; keep: record the draft distributions (lossless rule)."""
        noise = temperature > 0 if random else None
        temp = temperature_divisor(temperature)
        salt = SALT_TARGET if self.rule == "coupled" else SALT_DRAFT

        def sample(i: int, logits: torch.Tensor) -> torch.Tensor:
            scaled = logits / temp
            if keep and i < self.gamma:
                self.draft_logits[slots, i] = scaled
            return gumbel_argmax(scaled, noise, seeds, anchor_pos + 2 + i, salt)

        out = self.model.draft(self.pools, slots, anchor_pos, anchor, sample, self.gamma)
        if self.rule == "pinned":
            conf = pinned_confidence(self.config.acceptance, self.config.confidence_spread, seeds, anchor_pos + 2,
                                     self.gamma)
        else:
            conf = out.acceptance_confidence()
        return out.tokens, conf


def _write(plain: torch.Tensor, at: torch.Tensor, lengths: torch.Tensor, take: torch.Tensor,
           values: torch.Tensor) -> torch.Tensor:
    """plain [M] with values [R, L+1] written where take [R, L+1] at the logit rows at (Rows.grid), and the plain
    samples kept elsewhere; no boolean indexing (it would wait for the device). Slots past a row's length map to
    its last live row: they carry that row's value, so every write to one index writes the same thing."""
    new = torch.where(take, values, plain[at])
    new = new.gather(1, torch.minimum(torch.arange(at.shape[1], device=at.device).unsqueeze(0),
                                      lengths.unsqueeze(1)))
    return plain.clone().scatter_(0, at.flatten(), new.flatten())


class DraftGraphs:
    """CUDA graphs of the draft block, one per (padded row count on the runner's ladder, any row samples, draft
    distributions kept, kernel table). Padding rows draft for scratch slot 0 at position 0 (garbage no sequence
    reads); captured on first use with every row on scratch."""

    def __init__(self, speculator: Speculator, sizes: list[int]):
        self.speculator, self.sizes = speculator, sizes
        self.graphs: dict[tuple, tuple] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def run(self, args: tuple, random: bool, keep: bool):
        r = args[0].shape[0]
        size = next((s for s in self.sizes if s >= r), None)
        if size is None:
            return None
        key = (size, random, keep, active().name)
        with torch.cuda.device(args[0].device):
            if key not in self.graphs:
                self.graphs[key] = self._capture(size, args, random, keep)
            graph, inputs, (drafts, conf) = self.graphs[key]
            for buf, value in zip(inputs, args):
                buf.zero_()
                buf[:r].copy_(value)
            graph.replay()
            return drafts[:r], conf[:r]

    def _capture(self, size: int, like: tuple, random: bool, keep: bool):
        inputs = [torch.zeros((size,), dtype=a.dtype, device=a.device) for a in like]   # all rows on scratch
        graph, out = capture(lambda: self.speculator.block(*inputs, random, keep), self.mempool)
        return graph, inputs, out
