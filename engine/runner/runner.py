"""Runs one scheduled step on the model: feeds each sequence's next tokens as one flat batch, samples a token
for every sequence that reached the end of its known tokens, and gathers logprobs when asked."""

from __future__ import annotations

import torch

from ..sampling.sampler import build_sampling_tensors, logprobs, sample
from ..scheduler.request import Request


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.supports_last_only = model.cfg.model_type == "deepseek_v41"

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, int]:
        """Advances each sequence by its scheduled tokens; returns {request_id: sampled token} for those that
        completed their known tokens this step. Prompt logprobs are recorded on the requests."""
        chunks = [torch.tensor(r.all_ids[r.num_computed:r.num_computed + n]) for r, n in scheduled]
        want_prompt_lp = any(r.params.prompt_logprobs is not None and r.num_computed < len(r.prompt_ids)
                             for r, _ in scheduled)
        if self.supports_last_only and not want_prompt_lp:
            rows = self.model.extend(chunks, [r.state for r, _ in scheduled], last_only=True)
        else:
            rows = self.model.extend(chunks, [r.state for r, _ in scheduled])
        sampling, last_rows = [], []
        for (req, n), logits in zip(scheduled, rows):
            if req.params.prompt_logprobs is not None and req.num_computed < len(req.prompt_ids):
                self._prompt_logprobs(req, logits, n)
            req.num_computed += n
            if req.num_computed == req.num_tokens:
                sampling.append(req)
                last_rows.append(logits[-1])
        if not sampling:
            return {}
        logits = torch.stack(last_rows)
        t = build_sampling_tensors([r.params for r in sampling], [r.seed for r in sampling],
                                   [r.num_tokens for r in sampling], logits.shape[-1], logits.device,
                                   [r.prompt_ids for r in sampling], [r.output_ids for r in sampling],
                                   self.model.cfg.eos_token_id)
        tokens = sample(logits, t)
        for req, row, tok in zip(sampling, logits, tokens.tolist()):
            if req.params.logprobs is not None:
                chosen, ids, values = logprobs(row.unsqueeze(0), torch.tensor([tok], device=row.device),
                                               req.params.logprobs)
                entry = {tok: chosen.item()}
                if ids is not None:
                    entry.update({int(i): float(v) for i, v in zip(ids[0].tolist(), values[0].tolist())})
                req.logprobs = (req.logprobs or []) + [entry]
        return {r.request_id: tok for r, tok in zip(sampling, tokens.tolist())}

    @staticmethod
    def _prompt_logprobs(req: Request, logits: torch.Tensor, n: int) -> None:
        """Rows of prompt positions a..a+n-1 predict tokens a+1..a+n: log-softmax of each prompt token (+ top-k);
        the first prompt token has none (as vLLM)."""
        a = req.num_computed
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = req.params.prompt_logprobs
        for i in range(n):
            j = a + i + 1                                   # the prompt token row i predicts
            if j >= len(req.prompt_ids):
                break
            if j < len(req.prompt_logprobs):                # recomputed after a preemption: already recorded
                continue
            tok = req.prompt_ids[j]
            entry = {tok: float(lp[i, tok])}
            if k:
                top = lp[i].topk(k)
                entry.update({int(t): float(v) for t, v in zip(top.indices.tolist(), top.values.tolist())})
            req.prompt_logprobs.append(entry)
