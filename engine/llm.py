"""`LLM`: the offline entry point, vLLM-shaped (`from deepinfer import LLM, SamplingParams`).

    llm = LLM(model="path/or/hub-id", device="cuda", dtype="bfloat16", seed=0)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Requests are validated up front (one clear error, before any work); then the engine core (engine/core.py:
scheduler -> runner -> output processor) runs them to completion with continuous batching. `llm.engine` is
that core, `llm.stats` its statistics."""

from __future__ import annotations

import copy
import hashlib
import logging

import numpy as np
import torch

from .api import WEIGHT_PLACEMENT_DEFAULTS, host_resident_weights, keep_weights_on_host, load_model
from .errors import DeepInferError
from .cache.manager import PREFIX_SNAPSHOT_INTERVAL, StateManager
from .core import EngineConfig, EngineCore, unsupported
from .env import async_scheduling_default, check_environment, kernel_backend, yoco_prefill
from .models import check_projection_storage, projection_storage_of
from .output_processor import Detokenizer, byte_level
from .outputs import CompletionOutput, Logprob, RequestOutput
from .runner import ModelRunner
from .runner.inputs import PROMPT_LOGPROB_ROWS
from .runner.rate_profile import step_rate_table
from .sampling import SamplingParams
from .scheduler import Request
from .speculative.config import SpeculativeConfig, speculative_config
from .text import check_text
from .speculative.speculation import Speculation
from .stats import EngineStats
from .api import resolve_model
from .validate import (check_flag, check_model_spec, device_or_default, encode_prompt, parse_dtype, prompt_list,
                       refuse_unsupported, sampling_params_list)
from deepinfer.kernels.experts import weight_layout
from deepinfer.kernels.table import BACKEND_SETS, KernelTable, use

from .models.common.moe import Experts, expert_layout, set_expert_numerics, use_expert_parallel
from .parallel.balancer import EplbConfig, ExpertBalancer, eplb_config, layer_placement
from .parallel.context_parallel import prefill_prompts
from .parallel.expert_parallel import DISPATCHERS
from .parallel.ranks import ParallelConfig, join, parallel_config
from .parallel.traffic import ExpertTraffic
from .cache.pools import check_kv_cache_dtype

log = logging.getLogger("deepinfer")
INVARIANT_CONTEXT_HINT = 1 << 16    # above this, invariant mode's fixed-width entry lists get costly (docs/runtime.md)

ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": None,
                   "state_memory_bytes": None, "gpu_memory_utilization": 0.9, "enforce_eager": False,
                   "async_scheduling": None, "max_graph_batch": 512, "block_size": None, "expert_storage": "dense",
                   "projection_storage": "dense", "kv_cache_dtype": "auto",
                   "keep_quantized": False, "kernel_backend": None, "skip_tokenizer_init": False,
                   "expert_act_quant": False, "speculative": None, "expert_traffic": False,
                   "data_parallel_size": 1, "enable_expert_parallel": False, "expert_dispatch": "allgather",
                   "distributed_timeout_s": 600.0, "enable_eplb": False, "eplb_config": None,
                   "prefill_context_parallel_size": 1, "context_parallel_min_tokens": None,
                   "enable_prefix_caching": True, "prefix_snapshot_interval": None,
                   **WEIGHT_PLACEMENT_DEFAULTS}
MAX_LOGPROBS = 20      # as vLLM's default max_logprobs
CHAT_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}  # what templates read


def _positive_int(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeepInferError(f"{name}={value!r} must be an integer >= 1" + (" or None" if optional else ""))


def _check_snapshot_interval(value, caching: bool) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise DeepInferError(f"prefix_snapshot_interval={value!r} must be an integer >= 0 (positions between ring "
                             f"snapshots inside a prefill piece; 0: only where pieces end) or None (the default)")
    if value and not caching:
        raise DeepInferError(f"prefix_snapshot_interval={value} takes ring snapshots for the prefix cache, which is "
                             f"off: pass enable_prefix_caching=True, or drop it")


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | torch.dtype = "float32",
                 seed: int = 0, qat_fake_quant: bool = True, **engine_args):
        unknown = sorted(set(engine_args) - set(ENGINE_DEFAULTS))
        if unknown:
            raise DeepInferError(f"LLM() got unknown arguments {unknown}; known engine arguments: "
                                 f"{sorted(ENGINE_DEFAULTS)}")
        args = {**ENGINE_DEFAULTS, **engine_args}
        self._args = args
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "state_memory_bytes",
                     "max_graph_batch", "block_size"):
            _positive_int(name, args[name], optional=name in ("max_model_len", "state_memory_bytes", "block_size"))
        util = args["gpu_memory_utilization"]
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise DeepInferError(f"gpu_memory_utilization={util!r} must be a number in (0, 1]")
        for name in ("enforce_eager", "async_scheduling", "keep_quantized", "skip_tokenizer_init", "expert_act_quant",
                     "expert_traffic", "enable_prefix_caching"):
            check_flag(name, args[name], none_ok=name == "async_scheduling")
        check_flag("qat_fake_quant", qat_fake_quant)
        _check_snapshot_interval(args["prefix_snapshot_interval"], args["enable_prefix_caching"])
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DeepInferError(f"seed={seed!r} must be an integer >= 0")
        check_environment()
        model = check_model_spec(model)
        device = device_or_default(device)
        dtype = parse_dtype(dtype)
        parallel, eplb, device = self._join(args, set(engine_args), device)
        self.balancer: ExpertBalancer | None = None          # EPLB's live rebalancing (engine/parallel/balancer.py)
        if "gpu_memory_utilization" in engine_args and not device.startswith("cuda"):
            raise DeepInferError(f"gpu_memory_utilization sizes the state pools from GPU memory; on {device} it has "
                                 f"no effect: drop it, or set state_memory_bytes")
        backend = kernel_backend(args["kernel_backend"], device)   # a bad name is one line before the model loads
        if args["max_num_batched_tokens"] < args["max_num_seqs"]:
            raise DeepInferError(f"max_num_batched_tokens={args['max_num_batched_tokens']} is below max_num_seqs="
                                 f"{args['max_num_seqs']}: every running sequence needs a token of each step's budget")
        check_projection_storage(args["projection_storage"])
        check_kv_cache_dtype(args["kv_cache_dtype"])
        built = isinstance(model, torch.nn.Module)
        self._host_weights = host_resident_weights(device, args)   # a bad value: one line now
        self.model = self._model(model, device, dtype, qat_fake_quant, parallel, eplb)
        if built and "projection_storage" in engine_args \
                and projection_storage_of(self.model) != args["projection_storage"]:
            raise DeepInferError(f"projection_storage={args['projection_storage']!r} does not match the model passed "
                                 f"in, which holds its FP8 projections as {projection_storage_of(self.model)!r}: "
                                 f"drop the argument or build the model with it")
        set_expert_numerics(self.model, args["expert_act_quant"], weight_layout(backend, device))
        self.tokenizer = None if args["skip_tokenizer_init"] else self._load_tokenizer()
        limit = self.model.cfg.max_position_embeddings
        self.max_model_len = limit if args["max_model_len"] is None else args["max_model_len"]
        if not 1 <= self.max_model_len <= limit:
            raise DeepInferError(f"max_model_len={self.max_model_len} must be in 1..{limit} (max_position_embeddings)")
        self.rng = np.random.default_rng(seed)
        drafting = self.model.drafting          # None: the model cannot draft
        self.speculative = speculative_config(args["speculative"], None, None) if drafting is None else \
            speculative_config(args["speculative"], drafting.block_size, drafting.method)
        if self.speculative is not None and args["async_scheduling"]:
            raise DeepInferError("async_scheduling=True with speculative decoding: verify steps run the synchronous "
                                 "loop (each step's commits are read before the next is planned; docs/"
                                 "speculative.md); drop async_scheduling or speculative")
        async_scheduling = False if self.speculative is not None else async_scheduling_default() \
            if args["async_scheduling"] is None else args["async_scheduling"]
        self._balance(eplb)
        # routed-traffic counters (engine/parallel/traffic.py), wrapped around the dispatchers (local or expert-
        # parallel) before any graph is captured
        self.traffic = ExpertTraffic.install(self.model) if args["expert_traffic"] else None
        self._config = EngineConfig(args["max_num_seqs"], args["max_num_batched_tokens"], self.max_model_len,
                                    async_scheduling, lockstep=parallel.enable_expert_parallel)
        kernels = KernelTable(backend)
        if kernels.invariant and self.max_model_len > INVARIANT_CONTEXT_HINT:
            log.warning("batch-invariant mode reads every block column: with max_model_len=%d each row's entry "
                        "lists cover the whole length; set max_model_len to what the run needs", self.max_model_len)
        slack = self.speculative.num_speculative_tokens if self.speculative else 0
        drafts_idle = drafting.rings if drafting is not None and self.speculative is None else ()
        manager = StateManager(self.model, args["max_num_seqs"], self.max_model_len, self._state_budget(kernels),
                               args["block_size"], args["kv_cache_dtype"], ring_slack=slack,
                               prefix_salt=self._prefix_salt(kernels) if args["enable_prefix_caching"] else None,
                               idle_rings=drafts_idle,
                               snapshot_interval=self._snapshot_interval(args["prefix_snapshot_interval"]))
        self.engine = self._build_engine(kernels, manager)
        self._next_id = 0
        self._grammars = None          # engine/structured.Grammars, built with the first so_args request

    def _snapshot_interval(self, asked: int | None) -> int:
        """Positions between interior ring snapshots (docs/prefix-cache.md): none when the engine drafts (draft rings
        are written for a piece's last window only); by default none either where prefill pieces run truncated
        (V4.1's YOCO prefill: a marked piece runs whole, which costs more than the snapshots save a cold prompt)."""
        if self.speculative is not None:
            if asked:
                raise DeepInferError(f"prefix_snapshot_interval={asked} with speculative decoding: its draft rings "
                                     f"are written for a piece's last window only, so no interior snapshot could hold "
                                     f"them; drop prefix_snapshot_interval (or set 0) or speculative")
            return 0
        if asked is None:
            return 0 if yoco_prefill() and self.model.truncates_prefill else PREFIX_SNAPSHOT_INTERVAL
        return asked

    def _build_engine(self, kernels: KernelTable, manager: StateManager) -> EngineCore:
        """A runner over `manager`'s pools, told at construction whether decode shapes are fixed (invariant), and
        speculation (its step-rate table given, else profiled on this runner now)."""
        # expert-parallel steps read host values between ranks (engine/parallel/expert_parallel.py): eager
        # so do host-resident weights (each forward gathers their rows on the host: api.host_resident_weights)
        graphs = not self._args["enforce_eager"] and not self._args["enable_expert_parallel"] and not self._host_weights
        runner = ModelRunner(self.model, manager.pools, cuda_graphs=graphs,
                             max_graph_batch=min(self._args["max_graph_batch"], manager.num_slots),
                             fixed_context=kernels.invariant, speculative=self.speculative)
        decode = (lambda ids: "") if self.tokenizer is None else Detokenizer(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), byte_level(self.tokenizer))
        speculation = None
        if self.speculative is not None:
            rate = step_rate_table(runner, manager, self.speculative, self._config, kernels)
            speculation = Speculation.build(self.speculative, rate, runner.graphs, self._config.max_num_batched_tokens,
                                            self.max_model_len)
        return EngineCore(runner, manager, kernels, self._config, decode, self.model.cfg.eos_token_id,
                          speculation=speculation, traffic=self.traffic)

    def _join(self, args: dict, given: set[str], device: str) -> tuple[ParallelConfig, EplbConfig | None, str]:
        """The parallel settings checked, this process joined to its ranks (self.ranks; None: one rank) and to its
        context-parallel group (self.cp_group; None: no context parallelism), and the device this rank computes on."""
        parallel = parallel_config(args, given)
        eplb = eplb_config(args["enable_eplb"], args["eplb_config"], parallel.enable_expert_parallel, given)
        self.ranks = join(parallel, device)
        c = parallel.prefill_context_parallel_size        # this rank's context-parallel group (docs/parallel.md)
        self.cp_group = self.ranks.split(c) if c > 1 else None
        self.cp_min_tokens = parallel.context_parallel_min_tokens or args["max_num_batched_tokens"]
        self.context_parallel_prefills = 0        # this rank's requests whose prompt was prefilled over its group
        return parallel, eplb, device if self.ranks is None else self.ranks.device(device)

    def _model(self, model, device: str, dtype: torch.dtype, qat_fake_quant: bool, parallel: ParallelConfig,
               eplb: EplbConfig | None) -> torch.nn.Module:
        """The model this rank runs: a checkpoint loaded sharded (each expert-parallel rank allocates and reads only
        its experts, docs/parallel.md), or a built one (random:..., passed in) that then keeps its experts."""
        args = self._args
        model = resolve_model(model, device, dtype, args["expert_storage"], qat_fake_quant, args["projection_storage"])
        self._dispatchers = []                                # this rank's expert-parallel dispatchers
        if not isinstance(model, torch.nn.Module):
            return load_model(model, device=device, dtype=dtype, qat_fake_quant=qat_fake_quant,
                              keep_quantized=args["keep_quantized"], expert_storage=args["expert_storage"],
                              projection_storage=args["projection_storage"],
                              **{k: args[k] for k in WEIGHT_PLACEMENT_DEFAULTS},
                              prepare=lambda m: self._hold_experts(m, parallel, eplb))
        self._hold_experts(model, parallel, eplb)
        if self._host_weights:
            keep_weights_on_host(model, device.startswith("cuda"))
        return model

    def _hold_experts(self, model: torch.nn.Module, parallel: ParallelConfig, eplb: EplbConfig | None) -> None:
        """Expert parallelism: this rank keeps 1/N of every MoE layer's routed experts, or of its physical slots
        under an EPLB placement (engine/parallel/, docs/parallel.md). Run on the unmaterialized model before a
        checkpoint loads (the loader then reads only these experts), or on a built model (random:..., passed in)."""
        if not parallel.enable_expert_parallel:
            return
        if any(m.quantized for m in model.modules() if isinstance(m, Experts)):
            raise DeepInferError("enable_expert_parallel=True with a built model that keeps its quantized expert "
                                 "weights (keep_quantized): they cannot be split over ranks once loaded; pass the "
                                 "checkpoint directory instead, which each rank loads sharded")
        if self._args["keep_quantized"] and eplb is not None and eplb.step_interval:
            raise DeepInferError("keep_quantized=True with EPLB rebalancing: a rebalance moves the dense expert "
                                 "weights between ranks, not the attached quantized ones; drop keep_quantized or set "
                                 "eplb_config step_interval=0 (a static placement)")
        dispatcher = DISPATCHERS[parallel.expert_dispatch]

        def make(name: str, n_experts: int):
            placement = None if eplb is None else layer_placement(eplb, name, n_experts, self.ranks.size)
            self._dispatchers.append(dispatcher(n_experts, self.ranks, placement=placement))
            return self._dispatchers[-1]
        drafting = model.drafting      # draft layers stay whole: a draft block runs without collectives
        use_expert_parallel(model, make, drafting.modules if drafting is not None else ())

    def _balance(self, eplb: EplbConfig | None) -> None:
        """EPLB's live rebalancing over the dispatchers, once the weights are in place."""
        if eplb is not None and eplb.step_interval:
            self.balancer = ExpertBalancer(eplb, self._dispatchers, self.ranks)

    def with_kernel_backend(self, name: str) -> "LLM":
        """This engine under another kernel backend set (kernels/registry.py BACKEND_SETS): `self` when it already runs
        it, else a twin that shares the model, the tokenizer and the state pools (so no second memory budget):
        use the two one at a time."""
        if name not in BACKEND_SETS:
            raise DeepInferError(f"kernel backend {name!r} is not known; use one of {list(BACKEND_SETS)}")
        kernel_backend(name, str(next(self.model.parameters()).device))     # the Triton sets need CUDA: one line
        if name == self.engine.kernel_backend:
            return self
        twin = copy.copy(self)
        twin.engine = self._build_engine(KernelTable(name), self.engine.manager)
        return twin

    @property
    def batch_invariant(self) -> bool:
        """Whether the engine runs the batch-invariant kernels (and the scheduler's fixed chunk grid)."""
        return self.engine.kernels.invariant

    @property
    def async_scheduling(self) -> bool:
        return self.engine.async_scheduling

    @property
    def stats(self) -> EngineStats:
        """The engine's statistics (counters since it was built or `llm.engine.reset_stats()`)."""
        return self.engine.stats

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block and ring snapshot (vLLM's spelling): later requests start cold. Running
        sequences keep the blocks they hold (freed when they finish); a no-op without prefix caching."""
        self.engine.manager.forget_prefixes()

    @property
    def grammar_mask_stats(self) -> dict:
        """Steps that filled structured-output masks and the host seconds they took, since the first so_args
        request (engine/structured.MaskBuffer)."""
        m = self._grammars.masks if self._grammars is not None else None
        return {"fills": m.fills if m else 0, "fill_seconds": m.fill_seconds if m else 0.0}

    def get_tokenizer(self):
        """The checkpoint's tokenizer (a `tokenizers.Tokenizer`; None with skip_tokenizer_init=True)."""
        return self.tokenizer

    # ---- generation ----
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, **unsupported_args) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a {"prompt_token_ids": [...]} dict, or a list of these.
        A flat sequence of ints (list, tuple, 1-D numpy / torch integer array) is one prompt of token ids.
        One SamplingParams for all prompts or one per prompt. Returns one RequestOutput per prompt, in order."""
        refuse_unsupported("generate", unsupported_args, "prompts, sampling_params, use_tqdm")
        check_flag("use_tqdm", use_tqdm)
        groups = self._request_groups(prompt_list(prompts), sampling_params)
        # attention data parallelism: prompt i runs on rank i mod N; every rank made every request (the same
        # seeds as one rank draws) and returns every output
        mine = groups if self.ranks is None else groups[self.ranks.rank::self.ranks.size]
        # context parallelism: every rank prefills every long prompt's share together, the owner keeps the seat
        computed = {} if self.cp_group is None else prefill_prompts(self.engine, self.ranks, self.cp_group,
                                                                    [reqs for *_, reqs in groups], self.cp_min_tokens)
        self.context_parallel_prefills += len(computed)
        self._run([r for *_, reqs in mine for r in reqs], use_tqdm, computed)
        outputs = [self._output(rid, text, ids, reqs) for rid, text, ids, reqs in mine]
        if self.ranks is None:
            return outputs
        shares = self.ranks.gather_objects(outputs)
        return [shares[i % self.ranks.size][i // self.ranks.size] for i in range(len(groups))]

    def generate_local(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                       use_tqdm: bool = False) -> list[RequestOutput]:
        """This rank's own prompts (generate's forms, or an empty list), run on this rank only and returned here only (no
        gather): for callers that split requests over the ranks themselves (the bench harness, as vLLM's
        data-parallel ranks each take their own requests). Under expert parallelism every rank must call it
        together, each with its own share: the lockstep loop (`_run`) steps until every rank is done, a rank with
        nothing left running idle steps. With one rank it is `generate` without the single-prompt forms."""
        check_flag("use_tqdm", use_tqdm)
        if self.cp_group is not None:
            # a context-parallel prefill is a collective over the same prompt on every rank; here each rank holds
            # different prompts
            raise DeepInferError("generate_local cannot run context-parallel prefill (each rank holds its own "
                                 "prompts); build the LLM with prefill_context_parallel_size=1 or call generate")
        none = isinstance(prompts, (list, tuple)) and not prompts          # a rank without a share: idle steps
        groups = [] if none else self._request_groups(prompt_list(prompts), sampling_params)
        self._run([r for *_, reqs in groups for r in reqs], use_tqdm)
        return [self._output(rid, text, ids, reqs) for rid, text, ids, reqs in groups]

    def _request_groups(self, prompts: list, sampling_params) -> list[tuple]:
        """Every prompt checked before any work, then (request id, text, ids, its n requests) per prompt."""
        params = sampling_params_list(sampling_params, len(prompts))
        encoded = [encode_prompt(i, p, self.tokenizer, self.model.cfg.vocab_size, self.max_model_len)
                   for i, p in enumerate(prompts)]
        for i, sp in enumerate(params):
            self._check_params(i, sp)
        compiled = self._compile_grammars(params)                   # every schema compiled before any work
        groups = []
        for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
            rid = str(self._next_id)
            self._next_id += 1
            reqs = [self._request(rid, ids, sp, j, self._grammars.matcher(compiled[i]) if i in compiled else None)
                    for j in range(sp.n)]
            groups.append((rid, text, ids, reqs))
        return groups

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, **unsupported_args) -> list[RequestOutput]:
        """messages: one conversation ([{"role", "content"}, ...]) or a list of them, rendered with the
        checkpoint's chat template."""
        refuse_unsupported("chat", unsupported_args, "messages, sampling_params, use_tqdm, add_generation_prompt")
        check_flag("add_generation_prompt", add_generation_prompt)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DeepInferError("chat takes a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for c in conversations:
            if not isinstance(c, (list, tuple)) or not c or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in c):
                raise DeepInferError("every chat message must be a dict with string 'role' and 'content'")
            extra = sorted({k for m in c for k in m} - CHAT_MESSAGE_KEYS)
            if extra:
                raise DeepInferError(f"chat messages hold unknown keys {extra}; a message has "
                                     f"{sorted(CHAT_MESSAGE_KEYS)}")
            for j, m in enumerate(c):
                check_text(f"chat message {j} ({m['role']!r}) content", m["content"])
        ids = [{"prompt_token_ids": self.encode_chat(c, add_generation_prompt)} for c in conversations]
        return self.generate(ids, sampling_params, use_tqdm)

    # ---- the loop ----
    def _run(self, requests: list[Request], use_tqdm: bool, computed: dict[str, int] | None = None) -> None:
        """Run the requests to completion on the engine core; an error or interrupt mid-run gives every seat and
        block back (the engine stays usable). computed: {request id: prompt positions a context-parallel prefill
        left in its seat}; those requests go first (they hold seats already, so they must be admitted first)."""
        computed = computed or {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(requests), desc="generate", unit="seq")
        try:
            for r in sorted(requests, key=lambda r: r.request_id not in computed):
                self.engine.add_request(r, computed.get(r.request_id, 0))
            while self._unfinished():
                done = self.engine.step()
                if self.balancer is not None:
                    self.balancer.after_step()
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            self.engine.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()

    def _unfinished(self) -> bool:
        """Whether to step again: this engine has work, or (expert parallelism, lockstep) any rank has."""
        mine = self.engine.has_unfinished()
        return mine if not self.engine.config.lockstep else self.ranks.any(mine)

    def _prefix_salt(self, kernels: KernelTable) -> bytes:
        """What a cached block's state was computed by (cache/prefix.py): the model's family, config and dtype, its
        weights' storage and FP4 expert layout (which kernel reads them), the tokenizer binding its hashed lookups
        read, the kernel table, the state's dtype."""
        h = hashlib.blake2b(digest_size=16)
        m = self.model
        for part in (type(m).__name__, repr(m.cfg), str(m.dtype), self._args["expert_storage"], str(expert_layout(m)),
                     self._args["projection_storage"], kernels.name, self._args["kv_cache_dtype"]):
            h.update(part.encode() + b"\0")
        hasher = getattr(m, "hasher", None)
        if hasher is not None:                                   # token -> compressed id, from the tokenizer
            h.update(hasher.tables(torch.device("cpu")).token_map.numpy().tobytes())
        return h.digest()

    def _state_budget(self, kernels: KernelTable) -> int | None:
        """Bytes for the state pools: explicit, else (GPU) gpu_memory_utilization of the device minus the peak
        a profiled prefill of max_num_batched_tokens reaches, else None (the manager's CPU default)."""
        if self._args["state_memory_bytes"] is not None:
            return self._args["state_memory_bytes"]
        dev = self.model.device
        if dev.type != "cuda":
            return None
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        n = min(self._args["max_num_batched_tokens"], self.max_model_len - 1)
        ids = torch.randint(0, self.model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        profile_prefill(self.model, ids.to(dev), self._args["block_size"], kernels, self.max_model_len,
                        self._args["kv_cache_dtype"], self.speculative)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        budget = int(self._args["gpu_memory_utilization"] * total) - peak
        if budget <= 0:
            raise DeepInferError(f"no memory left for the state pools: the model and a {n}-token prefill peak at "
                                 f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise gpu_memory_utilization "
                                 f"or lower max_num_batched_tokens")
        return budget

    # ---- inputs ----
    def _check_params(self, i: int, sp: SamplingParams) -> None:
        """What SamplingParams cannot check alone: what the engine supports, ids against the vocabulary, logprob
        counts."""
        why = unsupported(sp)
        if why is not None:
            raise DeepInferError(f"request {i}: {why}")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise DeepInferError(f"request {i}: stop_token_ids {bad} are outside the vocabulary (0..{vocab - 1})")
        if sp.stop and self.tokenizer is None:
            raise DeepInferError(f"request {i}: stop strings need the tokenizer, but the engine was built with "
                                 f"skip_tokenizer_init=True; use stop_token_ids")
        if sp.so_args is not None and self.tokenizer is None:
            raise DeepInferError(f"request {i}: so_args compiles its grammar over the tokenizer's vocabulary, but "
                                 f"the engine was built with skip_tokenizer_init=True")
        if sp.so_args is not None and self.speculative is not None and self.speculative.acceptance is not None:
            # checked here, for every prompt on every rank, so no rank fails alone (the core checks it again)
            raise DeepInferError(f"request {i}: so_args with a pinned speculative acceptance model: pinned "
                                 f"acceptance ignores the tokens, so it would commit drafts the grammar refuses; drop "
                                 f"acceptance or so_args")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sp, name)
            if k is not None and k > min(MAX_LOGPROBS, vocab):
                raise DeepInferError(f"request {i}: {name}={k} exceeds the maximum {min(MAX_LOGPROBS, vocab)}")

    def _compile_grammars(self, params: list[SamplingParams]) -> dict[int, object]:
        """Prompt index -> its compiled grammar, for the prompts with so_args: every distinct schema submitted
        to the compiler threads first (they compile at once), then each waited for; a schema that does not
        compile is one line naming its request."""
        wanted = {i: sp.so_args for i, sp in enumerate(params) if sp.so_args is not None}
        if not wanted:
            return {}
        if self._grammars is None:
            from .structured import Grammars
            self._grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, [self.model.cfg.eos_token_id])
        futures = {i: self._grammars.submit(so) for i, so in wanted.items()}   # kept: none evicted mid-call
        return {i: self._grammars.compiled(f"request {i}", so, futures[i]) for i, so in wanted.items()}

    def _request(self, rid: str, ids: list[int], sp: SamplingParams, j: int, grammar=None) -> Request:
        """Sample j of a prompt; its draws use seed + j (mod 2^63; seeded) or a seed drawn from the engine's
        generator; grammar: its own matcher (so_args)."""
        seed = (sp.seed + j) % 2**63 if sp.seed is not None else int(self.rng.integers(0, 2**62))
        return Request(f"{rid}-{j}" if sp.n > 1 else rid, list(ids), sp, seed, index=j, grammar=grammar)

    def _output(self, rid: str, text, ids, reqs: list[Request]) -> RequestOutput:
        outs = [CompletionOutput(r.index, self._text(r), list(r.output_ids), self._decoded(r.logprobs),
                                 r.finish_reason, r.stop_reason) for r in reqs]
        prompt_lp = self._decoded(reqs[0].prompt_logprobs)
        if prompt_lp is None and reqs[0].params.prompt_logprobs is not None:
            prompt_lp = [None]                   # a 1-token prompt: its only token has no logprob (as vLLM)
        return RequestOutput(rid, text, list(ids), prompt_lp, outs,
                             all(r.finish_reason for r in reqs), [r.metrics for r in reqs])

    def _decoded(self, entries: list[dict | None] | None) -> list[dict[int, Logprob] | None] | None:
        """Logprob entries with each token's text (vLLM's decoded_token); unchanged without a tokenizer."""
        if entries is None or self.tokenizer is None:
            return entries
        text: dict[int, str] = {}

        def decoded(t: int) -> str:
            if t not in text:
                text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
            return text[t]
        return [None if e is None else {t: Logprob(lp.logprob, lp.rank, decoded(t)) for t, lp in e.items()}
                for e in entries]

    def _text(self, r: Request) -> str:
        return self.engine.output_text(r)          # a matched stop string is not part of the output

    def _load_tokenizer(self):
        from .checkpoint.tokenizer import read_tokenizer
        return read_tokenizer(self.model.checkpoint_dir, "LLM needs to encode text (or pass skip_tokenizer_init="
                                                         "True and give token-id prompts)")

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """One conversation as prompt token ids: render_chat's text through the tokenizer (no special tokens added:
        the template writes its own)."""
        if self.tokenizer is None:
            raise DeepInferError("chat renders text through the tokenizer, but the engine was built with "
                                 "skip_tokenizer_init=True; use generate with token ids")
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids

    def chat_template(self) -> tuple[str, dict]:
        """The checkpoint's chat template and its tokenizer_config.json (for bos / eos text)."""
        import json
        cfg_path = self.model.checkpoint_dir / "tokenizer_config.json"
        try:
            config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (OSError, ValueError) as err:
            raise DeepInferError(f"{cfg_path} could not be read as JSON ({type(err).__name__}); re-download it") \
                from None
        if not isinstance(config, dict):
            raise DeepInferError(f"{cfg_path} must hold a JSON object; re-download it")
        template = config.get("chat_template")
        if not template:
            raise DeepInferError(f"{self.model.checkpoint_dir} has no chat_template in tokenizer_config.json")
        return template, config

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """One conversation ([{"role", "content"}, ...]) as prompt text, through the checkpoint's chat template."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        template, config = self.chat_template()

        def raise_exception(msg):
            raise DeepInferError(f"chat template: {msg}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        special = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")  # noqa: E731  AddedToken dicts
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=special(config.get("bos_token")),
                                                 eos_token=special(config.get("eos_token")))


def profile_prefill(model, ids: torch.Tensor, block_size: int | None, kernels: KernelTable, max_model_len: int,
                    kv_cache_dtype: str = "auto", speculative: SpeculativeConfig | None = None) -> None:
    """The largest step the budget allows, run by a runner as the engine's would run it (ModelRunner.run_shape) on
    throw-away pools of one sequence: a prefill piece of ids [n] that records prompt logprobs (so, by the
    engine's rule, untruncated), with the logits and log-softmax of its first block of prompt-logprob rows (what
    such a piece computes at once, runner/inputs.PROMPT_LOGPROB_ROWS), reading the block columns the engine's
    step reads (all of them under the invariant table), the draft rings kept when speculating. Decode
    activations at the largest batch are not profiled."""
    from .cache.pools import PoolLayout, StatePools
    from .runner.inputs import StepInputs
    slack = speculative.num_speculative_tokens if speculative is not None else 0
    layout = PoolLayout.for_model(model, block_size, kv_cache_dtype, ring_slack=slack)
    n = ids.shape[0]
    blocks = max(layout.blocks_for(n), 1)
    pools = StatePools(layout, 1, blocks, max_model_len, model.device)
    pools.block_table[1, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    runner = ModelRunner(model, pools, cuda_graphs=False, max_graph_batch=1, fixed_context=kernels.invariant,
                         speculative=speculative)
    inputs = StepInputs.shaped([1], [0], [n], ids, list(range(min(n, PROMPT_LOGPROB_ROWS))))
    with use(kernels), torch.inference_mode():
        torch.log_softmax(runner.run_shape(inputs, graphed=False), dim=-1)   # the runner's largest block
