"""The lm-eval model backend `deepinfer`: lm-eval's requests run on the engine in-process.

    import deepinfer.evals.backend                      # registers the model name "deepinfer" with lm-eval
    lm_eval.simple_evaluate(model="deepinfer", model_args="pretrained=tiny,concurrency=8", tasks=[...])
    DeepInferLM(llm=LLM(...), concurrency=8)              # or around an engine already built

- loglikelihood: the context + continuation tokens go in as one prompt with `prompt_logprobs=1`; the answer is
  the sum of the continuation tokens' logprobs and whether each was the argmax (ties count as greedy).
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length = max_model_len - 2 tokens, each
  scored as above.
- generate_until: stop sequences (+ the EOS text), max_gen_toks, do_sample / temperature / top_p / top_k, a
  seed per request (backend seed + request index) when sampling; the context is left-truncated to leave room.
- concurrency: at most this many sequences run at once (the engine's seats); suites run the same requests at
  the maximum and the median concurrency, where batch-dependent regressions show.
Tokenization mirrors lm-eval's HF backend (the tokenizer's special tokens, BOS as the empty-context prefix), so
the two backends see the same token ids.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError


@register_model("deepinfer")
class DeepInferLM(TemplateLM):
    def __init__(self, pretrained: str = "tiny", device: str | None = None, dtype: str = "float32",
                 concurrency: int | None = None, max_gen_toks: int = 256, seed: int = 0,
                 qat_fake_quant: bool = True, batch_invariant: bool = False, llm=None, **engine_args):
        super().__init__()
        if llm is None:
            llm = build_engine(pretrained, device, dtype, seed, qat_fake_quant, engine_args)
        if batch_invariant:
            from deepinfer.harness.checks import set_mode
            set_mode(llm, True)
        self.llm, self.seed, self.max_gen_toks = llm, int(seed), int(max_gen_toks)
        self.tokenizer = llm.get_tokenizer()
        self.concurrency = int(concurrency or llm.args["max_num_seqs"])
        if not 1 <= self.concurrency <= llm.args["max_num_seqs"]:
            raise DeepInferError(f"concurrency={self.concurrency} must be in 1..max_num_seqs "
                                 f"({llm.args['max_num_seqs']})")
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
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self._generate(prompts, params, disable_tqdm)
        results = []
        for out, n in zip(outs, spans):
            ids, lps = out.prompt_token_ids, out.prompt_logprobs
            total, greedy = 0.0, True
            for tok, entry in zip(ids[-n:], lps[-n:]):
                lp = entry[tok]
                total += lp
                greedy = greedy and lp >= max(entry.values())
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
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen = int(kw.pop("max_gen_toks"))
            if max_gen >= self.llm.max_model_len:
                raise DeepInferError(f"max_gen_toks={max_gen} must be below max_model_len={self.llm.max_model_len}")
            sample = bool(kw.pop("do_sample", False)) and float(kw.get("temperature", 0.0)) > 0
            sampling = dict(temperature=float(kw.get("temperature", 0.0)), top_p=float(kw.get("top_p", 1.0)),
                            top_k=int(kw.get("top_k", 0) or 0), seed=self.seed + i) if sample else \
                dict(temperature=0.0)
            ids = self.tok_encode(context)[-(self.llm.max_model_len - max_gen):]
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=max_gen, stop=[s for s in until if s], **sampling))
            stops.append(until)
        outs = self._generate(prompts, params, disable_tqdm)
        results = []
        for req, out, until in zip(requests, outs, stops):
            text = out.outputs[0].text
            for term in until:             # as lm-eval's HF backend: cut at the first stop sequence
                if term:
                    text = text.split(term)[0]
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results

    def _generate(self, prompts, params, disable_tqdm: bool):
        from deepinfer.harness.workload import seats
        if not prompts:
            return []
        with seats(self.llm, self.concurrency):
            return self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)


def build_engine(model: str, device: str | None, dtype: str, seed: int, qat_fake_quant: bool, engine_args: dict):
    """LLM for a model name: a checkpoint dir, a hub id, `tiny` (the embedded model) or random:ARCH:PRESET:N."""
    from deepinfer import LLM
    from deepinfer.checkpoint.make import resolve_model
    model = resolve_model(str(model), device or "cpu", dtype, engine_args.get("expert_storage", "dense"),
                          qat=bool(qat_fake_quant))
    return LLM(model=model, device=device, dtype=dtype, seed=int(seed), qat_fake_quant=bool(qat_fake_quant),
               **engine_args)
