"""An op-level decode step of a V3-shaped model (MLA attention; routed + shared experts) for one rank of an EP-N
deployment with attention DP: each op's bytes and FLOPs, timed at the published rates of the kernels large-EP
deployments ran (kernel_rates.py), summed over the layers; dispatch / combine from the comm model; the two
micro-batches overlapped as project_decode does it (step.overlapped). It checks the projection's structure against
deployments we cannot run, on the shapes they ran, without our own kernels in the loop (docs/projection.md,
"Validation").

Per micro-batch of t = batch x query_tokens / micro_batches rows, per layer:
    q_a + kv_a   t x 7168 @ 7168 x 2112            FP8 GEMM (DeepGEMM)
    q_b          t x 1536 @ 1536 x 24576
    kv_b         q . W_UK and o . W_UV, absorbed    per head 128 x 512, both ways (timed at kv_b's GEMM rates)
    attention    t query rows over batch / micro_batches x context cached 576-wide latents (FlashMLA)
    o            t x 16384 @ 16384 x 7168
  dense layers: gate_up t x 7168 @ 7168 x 36864, down t x 18432 @ 18432 x 7168
  MoE layers:   router (BF16), shared expert (FP8 GEMMs), routed experts: the rank's ceil((256 + redundant) / N)
                experts over t x 8 balanced pairs (DeepGEMM masked layout), dispatch + combine of t tokens
then the LM head over every row once a step, and a drafting MTP block (one more MoE layer over one row a sequence,
its input projection and its head) where the deployment drafts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from deepinfer.errors import DeepInferError

from .comm import AlphaBeta
from .hardware import Profile
from .kernel_rates import Kernel
from .step import OVERLAPS, ModelShape, overlapped

KV_CACHE_DTYPES = ("bf16", "fp8")
FP8_BLOCK = 128              # FP8 weights carry one 4-byte scale per 128 x 128 block (V3's checkpoint)


@dataclass(frozen=True)
class MlaMoeShape:
    """The released shape of an MLA + MoE model (the deepseek-ai config.json's fields)."""
    name: str
    layers: int              # decoder layers
    dense_layers: int        # the first ones: a dense MLP, no experts
    hidden: int
    q_lora: int
    kv_lora: int
    rope_dim: int
    heads: int
    qk_nope: int
    v_head: int
    experts: int             # routed
    top_k: int
    shared_experts: int
    moe_inter: int
    dense_inter: int
    vocab: int

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def latent(self) -> int:
        """What MLA caches per token and layer: the compressed KV and the shared RoPE key (576 on V3)."""
        return self.kv_lora + self.rope_dim

    def kv_bytes_per_token(self, dtype: str) -> int:
        if dtype == "bf16":
            return self.latent * 2
        # FlashMLA's FP8 cache: the latent in FP8 with a 4-byte scale per 128, the RoPE part in BF16 (656 on V3)
        return self.kv_lora + self.kv_lora // FP8_BLOCK * 4 + self.rope_dim * 2


# deepseek-ai/DeepSeek-V3 config.json (R1 has the same shape)
SHAPES = {"v3": MlaMoeShape("v3", layers=61, dense_layers=3, hidden=7168, q_lora=1536, kv_lora=512, rope_dim=64,
                            heads=128, qk_nope=128, v_head=128, experts=256, top_k=8, shared_experts=1,
                            moe_inter=2048, dense_inter=18432, vocab=129280)}


@dataclass(frozen=True)
class Deployment:
    """One decode rank of an EP deployment with attention DP, as a published configuration states it."""
    gpu: str                 # hardware profile
    ep: int
    batch: float             # sequences on the rank
    context: float           # KV positions each sequence attends over
    redundant_experts: int = 0
    kv_cache: str = "bf16"
    query_tokens: int = 1    # rows each sequence feeds a step: 2 when MTP-1's draft is verified
    draft_layers: int = 0    # MTP blocks run each step to draft (0: no drafting)
    tokens_per_step: float = 1.0
    micro_batches: int = 2
    overlap: str = "two_micro_batches"
    backend: str = "deepep_ll"

    def check(self) -> None:
        if self.ep < 1 or self.batch <= 0 or self.context <= 0 or self.query_tokens < 1 or self.micro_batches < 1:
            raise DeepInferError(f"deployment on {self.gpu}: EP {self.ep}, batch {self.batch}, context "
                                 f"{self.context}, query tokens {self.query_tokens} and micro-batches "
                                 f"{self.micro_batches} must all be positive")
        if self.kv_cache not in KV_CACHE_DTYPES:
            raise DeepInferError(f"kv_cache {self.kv_cache!r}: use one of {list(KV_CACHE_DTYPES)}")
        if self.overlap not in OVERLAPS:
            raise DeepInferError(f"overlap {self.overlap!r}: use one of {list(OVERLAPS)}")


@dataclass(frozen=True)
class Op:
    """One kernel call and how many times a step makes it."""
    name: str
    kernel: str              # a kernel_rates entry
    calls: float             # per step
    flops: float             # one call
    nbytes: float            # one call
    m: float = 0.0           # the rate lookup's shape: rows (per expert for grouped GEMMs) and the weight's n x k
    n: int = 0
    k: int = 0


def fp8_weight_bytes(n: int, k: int) -> float:
    return n * k + math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK) * 4


def gemm(name: str, calls: float, rows: float, n: int, k: int) -> Op:
    """rows x k (FP8 in) @ k x n (FP8 weights) -> rows x n (BF16): DeepGEMM's byte count."""
    return Op(name, "deepgemm_fp8_gemm", calls, 2 * rows * n * k, fp8_weight_bytes(n, k) + rows * k + rows * n * 2,
              rows, n, k)


def bf16_gemm(name: str, calls: float, rows: float, n: int, k: int) -> Op:
    """BF16 weights and rows in, FP32 out (the router's scores, the head's logits)."""
    return Op(name, "gemm_bf16", calls, 2 * rows * n * k, n * k * 2 + rows * k * 2 + rows * n * 4, rows, n, k)


def experts_per_rank(shape: MlaMoeShape, dep: Deployment) -> int:
    return math.ceil((shape.experts + dep.redundant_experts) / dep.ep)


def attention_ops(shape: MlaMoeShape, dep: Deployment, calls: float, rows: float, seqs: float) -> list[Op]:
    """One MLA block over `rows` query rows of `seqs` sequences (absorbed decode: attention runs in the latent)."""
    qk = shape.qk_nope + shape.rope_dim
    absorbed = shape.heads * (shape.qk_nope * shape.kv_lora + shape.kv_lora * shape.v_head)      # W_UK, W_UV
    attend = Op("attention (FlashMLA)", f"flashmla_{dep.kv_cache}_decode", calls,
                # per row and head: scores over the 576-wide latents, values over the 512-wide ones
                2 * rows * shape.heads * dep.context * (shape.latent + shape.kv_lora),
                seqs * dep.context * shape.kv_bytes_per_token(dep.kv_cache)
                + rows * shape.heads * (shape.latent + shape.kv_lora) * 2)
    return [gemm("q_a + kv_a", calls, rows, shape.q_lora + shape.latent, shape.hidden),
            gemm("q_b", calls, rows, shape.heads * qk, shape.q_lora),
            Op("kv_b absorbed", "deepgemm_fp8_gemm", calls, 2 * rows * absorbed,
               absorbed + rows * shape.heads * (shape.qk_nope + 2 * shape.kv_lora + shape.v_head) * 2,
               rows, shape.heads * (shape.qk_nope + shape.v_head), shape.kv_lora),
            attend,
            gemm("o", calls, rows, shape.hidden, shape.heads * shape.v_head)]


def moe_ops(shape: MlaMoeShape, dep: Deployment, calls: float, rows: float) -> list[Op]:
    """One MoE block over `rows` tokens: router, shared expert, the rank's routed experts at balanced pairs."""
    held = experts_per_rank(shape, dep)
    pairs = rows * shape.top_k               # balanced: every rank receives as many pairs as it sends
    per_expert = pairs / held
    up, down = 2 * shape.moe_inter, shape.moe_inter
    shared = shape.shared_experts * shape.moe_inter
    return [bf16_gemm("router", calls, rows, shape.experts, shape.hidden),
            gemm("shared gate_up", calls, rows, 2 * shared, shape.hidden),
            gemm("shared down", calls, rows, shape.hidden, shared),
            Op("experts gate_up (masked)", "deepgemm_fp8_masked", calls, 2 * pairs * up * shape.hidden,
               held * fp8_weight_bytes(up, shape.hidden) + pairs * shape.hidden + pairs * up * 2,
               per_expert, up, shape.hidden),
            Op("experts down (masked)", "deepgemm_fp8_masked", calls, 2 * pairs * shape.hidden * down,
               held * fp8_weight_bytes(shape.hidden, down) + pairs * down + pairs * shape.hidden * 2,
               per_expert, shape.hidden, down)]


def decode_ops(shape: MlaMoeShape, dep: Deployment) -> list[Op]:
    """Every op of one decode step of one rank."""
    dep.check()
    micro = dep.micro_batches
    rows = dep.batch * dep.query_tokens / micro          # per micro-batch, through every layer
    seqs = dep.batch / micro
    ops = attention_ops(shape, dep, shape.layers * micro, rows, seqs)
    dense = shape.dense_layers * micro
    ops += [gemm("dense gate_up", dense, rows, 2 * shape.dense_inter, shape.hidden),
            gemm("dense down", dense, rows, shape.hidden, shape.dense_inter)]
    ops += moe_ops(shape, dep, shape.moe_layers * micro, rows)
    ops.append(bf16_gemm("lm head", 1, dep.batch * dep.query_tokens, shape.vocab, shape.hidden))
    if dep.draft_layers:
        # the MTP block drafts one token a sequence: its input projection (embedding and hidden state, 2 x hidden
        # -> hidden), one MLA + MoE layer over one row a sequence, and the shared head
        calls = dep.draft_layers * micro
        draft = [gemm("eh_proj", calls, seqs, shape.hidden, 2 * shape.hidden)]
        draft += attention_ops(shape, dep, calls, seqs, seqs) + moe_ops(shape, dep, calls, seqs)
        draft.append(bf16_gemm("lm head", dep.draft_layers, dep.batch, shape.vocab, shape.hidden))
        ops += [replace(o, name=f"draft {o.name}") for o in draft]
    return ops


@dataclass
class OpStep:
    """One projected decode step of one rank."""
    step_ms: float
    compute_ms: float                # every op, every layer, both micro-batches
    comm_ms: float                   # every MoE layer's dispatch + combine, both micro-batches
    serial_step_ms: float            # compute + comm: the step with no overlap at all
    output_tok_s_per_gpu: float
    serial_tok_s_per_gpu: float
    output_tok_s_per_user: float
    op_ms: dict[str, float] = field(default_factory=dict)    # per step, by op (draft ops apart)
    flags: tuple[str, ...] = ()


def project_ops(shape: MlaMoeShape, dep: Deployment, target: Profile, profiles: dict[str, Profile],
                kernels: dict[str, Kernel], comm: dict[tuple[str, str, str], AlphaBeta]) -> OpStep:
    """The decode step of one rank of `dep` on `target`. profiles: by name, for the GPU each kernel's rates were
    published on; comm: comm.fit()'s (backend, link, op) -> series."""
    flags: list[str] = []
    op_ms: dict[str, float] = {}
    for op in decode_ops(shape, dep):
        if op.kernel not in kernels:
            raise DeepInferError(f"anchors.json: no kernel_rates.{op.kernel} (op {op.name}); add its published rates")
        kernel = kernels[op.kernel]
        if kernel.gpu not in profiles:
            raise DeepInferError(f"kernel_rates.{op.kernel} was published on {kernel.gpu}, which hardware.json has "
                                 f"no profile of")
        rate = kernel.rate(op.m, op.n, op.k, target, profiles[kernel.gpu])
        flags += rate.flags
        op_ms[op.name] = op_ms.get(op.name, 0.0) + op.calls * rate.time_s(op.flops, op.nbytes) * 1e3
    compute = sum(op_ms.values())
    exchanging = shape.moe_layers + dep.draft_layers
    comm_ms = 0.0
    if dep.ep > 1:
        link = target.link(dep.ep)
        shaped = ModelShape(shape.hidden, shape.vocab, exchanging, shape.top_k)
        missing = [op for op in ("dispatch", "combine") if (dep.backend, link, op) not in comm]
        if missing:
            raise DeepInferError(f"comm.json has no {dep.backend}/{link}/{missing[0]} series for EP {dep.ep} on "
                                 f"{target.name}")
        ops = {op: comm[(dep.backend, link, op)] for op in ("dispatch", "combine")}
        micro = dep.micro_batches
        comm_ms = (shaped.exchange_ms(ops, dep.ep, dep.batch * dep.query_tokens, micro, flags, shape.moe_layers)
                   + shaped.exchange_ms(ops, dep.ep, dep.batch, micro, flags, dep.draft_layers))
    step = overlapped(compute, comm_ms, exchanging, dep.overlap)
    serial = compute + comm_ms
    per_gpu = dep.batch * dep.tokens_per_step * 1e3
    return OpStep(step, compute, comm_ms, serial, per_gpu / step, per_gpu / serial,
                  dep.tokens_per_step * 1e3 / step, op_ms, tuple(dict.fromkeys(flags)))
