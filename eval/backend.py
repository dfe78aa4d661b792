"""The lm-eval model backend `deepinfer`: lm-eval's requests run on the engine in-process.

    import deepinfer.evals.backend                      # registers the model name "deepinfer" with lm-eval
    lm_eval.simple_evaluate(model="deepinfer", model_args="pretrained=tiny,concurrency=8", tasks=[...])
    DeepInferLM(llm=LLM(...), concurrency=8)              # or around an engine already built

- loglikelihood: the context + continuation tokens go in as one prompt with `prompt_logprobs=1`; the answer is
  the sum of the continuation tokens' logprobs and whether each was the argmax (ties count as greedy).
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length = max_model_len - 2 tokens, each
  scored as above.
- generate_until: stop sequences (+ the EOS text), max_gen_toks, do_sample / temperature / top_p / top_k / min_p
  / penalties, so_args (a grammar in DeepInfer's spelling, as SamplingParams takes it: a task's
  generation_kwargs can constrain its replies); anything else is an error. A seed per request (backend seed,
  task, doc, index) when sampling; the context is left-truncated to max_length - max_gen_toks, as the HF backend
  does.
- concurrency: at most this many sequences run at once (the engine's seats); suites run the same requests at
  the maximum and the median concurrency, where batch-dependent regressions show.
Tokenization mirrors lm-eval's HF backend (the tokenizer's special tokens, BOS as the empty-context prefix), so
the two backends see the same token ids.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
PASSED_GEN_KWARGS = ("top_p", "top_k", "min_p", "so_args") + PENALTIES   # gen kwargs that map onto SamplingParams


@register_model("deepinfer")
class DeepInferLM(TemplateLM):
    def __init__(self, pretrained: str = "tiny", device: str | None = None, dtype: str = "float32",
                 concurrency: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 qat_fake_quant: bool = True, batch_invariant: bool | None = None, progress: bool = True,
                 think_end_token: str | None = None, llm=None, **engine_args):
        super().__init__()
        if llm is None:
            llm = build_engine(pretrained, device, dtype, seed, qat_fake_quant, engine_args)
        if batch_invariant is not None:              # None: keep the engine's mode (DEEPINFER_BATCH_INVARIANT)
            from deepinfer.harness.checks import with_mode
            llm = with_mode(llm, bool(batch_invariant))     # an engine of that kernel backend on the same model
        self.llm, self.seed, self.max_gen_toks = llm, int(seed), int(max_gen_toks)
        self.progress, self.think_end_token = bool(progress), think_end_token
        self.tokenizer = llm.get_tokenizer()
        self.concurrency = int(concurrency or llm.engine.max_num_seqs)
        if not 1 <= self.concurrency <= llm.engine.max_num_seqs:
            raise DeepInferError(f"concurrency={self.concurrency} must be in 1..max_num_seqs "
                                 f"({llm.engine.max_num_seqs})")
        self.name = str(pretrained)
        self._device, self._rank, self._world_size = llm.model.device, 0, 1
        cfg = llm.model.cfg
        self._eot, self._bos = cfg.eos_token_id, cfg.bos_token_id
        self._bos_text = self.tokenizer.id_to_token(self._bos)

    # ---- tokenization (as lm-eval's HF backend) ----
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._bos

    @property
    def max_length(self) -> int:
        """Most tokens a scored position conditions on (lm-eval's HF backend meaning): a scored sequence is at most
        max_length + 1 tokens, and a prompt must stay below max_model_len (one generated token follows it)."""
        return self.llm.max_model_len - 2

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = not (self._bos_text and string.startswith(self._bos_text))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.model.checkpoint_dir).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.llm.chat_template()[0] if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.llm.render_chat(chat_history, add_generation_prompt)

    # ---- scoring ----
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [((context, continuation), context_ids, continuation_ids)] -> [(sum logprob, is greedy)]."""
        results = self.score_continuations([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def score_continuations(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True
                            ) -> list[tuple[float, bool]]:
        """[(context ids, continuation ids)] -> [(sum of the continuation's logprobs, every token the argmax)].
        The context is left-truncated so the whole prompt fits; a continuation that cannot fit is an error."""
        prompts, spans = [], []
        for ctx, cont in pairs:
            if not cont:
                raise DeepInferError("lm-eval sent an empty continuation to score")
            if len(cont) > self.max_length:
                raise DeepInferError(f"a continuation of {len(cont)} tokens does not fit max_model_len="
                                     f"{self.llm.max_model_len}; raise max_model_len")
            ids = (list(ctx) + list(cont))[-(self.max_length + 1):]
            prompts.append({"prompt_token_ids": ids})
            spans.append(len(cont))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)   # each token's Logprob has its rank
        outs = self._generate(prompts, params, disable_tqdm)
        results = []
        for out, n in zip(outs, spans):
            ids, lps = out.prompt_token_ids, out.prompt_logprobs
            total, greedy = 0.0, True
            for tok, entry in zip(ids[-n:], lps[-n:]):
                total += entry[tok].logprob
                greedy = greedy and entry[tok].rank == 1            # ties with the best token count as greedy
            results.append((total, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(i)
        scores = self.score_continuations(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation ----
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen = int(kw.pop("max_gen_toks"))
            if max_gen >= self.max_length:          # as the HF backend: context + reply within max_length
                raise DeepInferError(f"max_gen_toks={max_gen} must be below max_length={self.max_length} "
                                     f"(max_model_len - 2); raise max_model_len")
            ids = self.tok_encode(context)[-(self.max_length - max_gen):]
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=max_gen, stop=[s for s in until if s],
                                         **self._sampling(kw, req)))
            stops.append(until)
        outs = self._generate(prompts, params, disable_tqdm)
        results = []
        for req, out, until in zip(requests, outs, stops):
            text = postprocess_generated_text(out.outputs[0].text, until, self.think_end_token)
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results

    def _sampling(self, kw: dict, req) -> dict:
        """SamplingParams fields for one request's normalized gen kwargs. Greedy unless do_sample with a
        temperature > 0; then a seed from (backend seed, task, doc, request index), so a sampled reply does not
        depend on which other tasks or how many docs run. Settings SamplingParams lacks are an error."""
        import zlib
        sample = bool(kw.pop("do_sample", False)) and float(kw.get("temperature", 0.0)) > 0
        temperature = float(kw.pop("temperature", 0.0))
        unknown = sorted(set(kw) - set(PASSED_GEN_KWARGS))
        if unknown:
            raise DeepInferError(f"generation settings {unknown} are not supported by the deepinfer backend; "
                                 f"supported: until, max_gen_toks, do_sample, temperature, "
                                 f"{', '.join(PASSED_GEN_KWARGS)}")
        passed = {k: kw[k] for k in PASSED_GEN_KWARGS if k in kw}
        if not sample:
            return dict(temperature=0.0, **{k: v for k, v in passed.items() if k in PENALTIES + ("so_args",)})
        key = f"{getattr(req, 'task_name', None)}/{getattr(req, 'doc_id', None)}/{req.idx}"
        return dict(temperature=temperature, seed=(self.seed + zlib.crc32(key.encode())) % 2**63, **passed)

    def _generate(self, prompts, params, disable_tqdm: bool):
        from deepinfer.harness.workload import seats
        if not prompts:
            return []
        with seats(self.llm, self.concurrency):
            return self.llm.generate(prompts, params, use_tqdm=self.progress and not disable_tqdm)


def build_engine(model: str, device: str | None, dtype: str, seed: int, qat_fake_quant: bool, engine_args: dict):
    """LLM for a model name: a checkpoint dir, a hub id, `tiny` (the embedded model) or random:ARCH:PRESET:N."""
    from deepinfer import LLM
    from deepinfer.api import resolve_model
    from deepinfer.env import accelerator
    device = device or accelerator()
    model = resolve_model(str(model), device, dtype, engine_args.get("expert_storage", "dense"),
                          qat=bool(qat_fake_quant), projection_storage=engine_args.get("projection_storage", "dense"))
    return LLM(model=model, device=device, dtype=dtype, seed=int(seed), qat_fake_quant=bool(qat_fake_quant),
               **engine_args)
