"""One projected decode step of an EP-N deployment: the busiest rank's compute (measured rank view, scaled to the
model's full depth and the target GPU) and the dispatch / combine of every MoE layer (the comm model), overlapped
over two micro-batches as DeepSeek's decode does (docs/projection.md has the formulas and their error band)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer.errors import DeepInferError

from .calibration import Calibration
from .comm import AlphaBeta
from .hardware import Profile

OVERLAPS = ("two_micro_batches", "none")
FP8_SCALE_GROUP = 128        # FP8 dispatch: one 4-byte scale per 128 channels (DeepEP low-latency's layout)


@dataclass(frozen=True)
class ModelShape:
    """What the projection needs of the model at its released depth."""
    hidden: int
    vocab: int
    layers: int                  # decoder layers; every one has a routed MoE (V4, V4.1)
    top_k: int

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        return cls(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts_per_tok)

    def dispatch_bytes(self, tokens: float) -> float:
        """FP8 rows out of one rank for `tokens` tokens: one copy per routed expert."""
        return tokens * self.top_k * (self.hidden + self.hidden // FP8_SCALE_GROUP * 4)

    def combine_bytes(self, tokens: float) -> float:
        """BF16 expert outputs back to one rank."""
        return tokens * self.top_k * self.hidden * 2

    def exchange_ms(self, comm: dict, ep: int, tokens: float, micro: int, flags: list[str],
                    layers: int | None = None) -> float:
        """Dispatch + combine of `tokens` tokens a step in `micro` micro-batches over `layers` MoE layers (default:
        every layer), in ms; comm: op -> its AlphaBeta. What stood in for data goes to `flags`."""
        per_layer = 0.0
        for op, nbytes in (("dispatch", self.dispatch_bytes(tokens / micro)),
                           ("combine", self.combine_bytes(tokens / micro))):
            est = comm[op].time(ep, nbytes)
            flags += [f"{op}: {f}" for f in est.flags]
            per_layer += est.us * micro / 1e3
        return per_layer * (self.layers if layers is None else layers)


def overlapped(compute_ms: float, comm_ms: float, layers: int, overlap: str, overlap_share: float = 1.0) -> float:
    """A step of `layers` layers whose compute and exchange total compute_ms and comm_ms. Two micro-batches: one's
    exchange runs under the other's compute, hiding at most the smaller side less half a layer of it (the
    pipeline's fill); `overlap_share` is the share of that a deployment achieves (1: all of it; the published
    deployments hide less: harness/projection/validate.py fits it). "none": they add up."""
    if overlap not in OVERLAPS:
        raise DeepInferError(f"overlap={overlap!r}: use one of {list(OVERLAPS)}")
    if overlap == "none":
        return compute_ms + comm_ms
    smaller = min(compute_ms, comm_ms)
    return compute_ms + comm_ms - overlap_share * (smaller - smaller / (2 * layers))


@dataclass(frozen=True)
class Projected:
    step_ms: float
    compute_ms: float            # the busiest rank, full depth, target GPU
    comm_ms: float               # every MoE layer's dispatch + combine, both micro-batches
    exposed_comm_ms: float       # what the overlap leaves on the step
    output_tok_s_per_rank: float     # of the rank holding the batch (idle ranks of a deployment are not counted)
    output_tok_s_per_user: float
    flags: tuple[str, ...]

    def fields(self) -> dict:
        return asdict(self)


def project_decode(cal: Calibration, measured_on: Profile, target: Profile, shape: ModelShape,
                   comm: dict[str, AlphaBeta], ep: int, batch: int, context: int,
                   overlap: str = "two_micro_batches", tokens_per_step: float = 1.0,
                   query_len: int = 1, overlap_share: float = 1.0) -> Projected:
    """The decode step of one rank holding `batch` sequences at `context` positions in an EP-`ep` deployment on
    `target` GPUs. comm: op ("dispatch", "combine") -> the fitted series of the backend on `target.link(ep)`.
    tokens_per_step: tokens each sequence gains per step (1; a speculative step's accepted length); query_len:
    tokens each sequence feeds the step (1; a verify step's drafts + 1); overlap_share: the share of the hideable exchange
    the overlap hides (step.overlapped)."""
    if overlap not in OVERLAPS:
        raise DeepInferError(f"overlap={overlap!r}: use one of {list(OVERLAPS)}")
    tokens = batch * query_len           # rows through the dense layers and the experts
    look = cal.lookup(ep, tokens, context)
    flags = list(look.flags)
    if query_len > 1:
        # a verify step reads each row's state once, not query_len times: as a decode step of tokens rows it
        # overcounts the attention reads (small at decode contexts, where weights dominate the bytes)
        flags.append(f"verify step of {batch} x {query_len} tokens read as a decode step of {tokens} rows")
    # full depth: the LM head's bytes are paid once per step, the rest per layer (decode reads, roughly by bytes)
    head = min(shape.vocab * shape.hidden * 2 / look.total_bytes, 1.0)
    depth = head + (1 - head) * shape.layers / cal.layers
    if shape.layers != cal.layers:
        flags.append(f"compute scaled from the calibration's {cal.layers} layers to {shape.layers} ({depth:.3g}x)")
    # the busiest rank: the routed-expert share of the step grows with its pairs over this rank's
    busiest = 1 + look.expert_fraction * (look.busiest_over_own - 1)
    # another GPU: decode is memory-bound, so the step scales with the measured copy rates' ratio
    gpu = measured_on.memory_bytes_per_s / target.memory_bytes_per_s
    if target.name != measured_on.name:
        flags.append(f"compute scaled from {measured_on.name} to {target.name} by memory bandwidth")
    compute = look.busy_ms * depth * busiest * gpu
    micro = 2 if overlap == "two_micro_batches" else 1
    comm_ms = shape.exchange_ms(comm, ep, tokens, micro, flags) if ep > 1 else 0.0     # EP 1: no exchange
    step = overlapped(compute, comm_ms, shape.layers, overlap, overlap_share)
    exposed = step - compute
    return Projected(step, compute, comm_ms, exposed, batch * tokens_per_step / step * 1e3,
                     tokens_per_step / step * 1e3, tuple(dict.fromkeys(flags)))
