"""Per-request output state, advanced from committed tokens only: output ids, logprobs, finish reasons, stop
strings, timings.

A step commits 0..q+1 tokens per row (a verify row: its accepted drafts and one more, engine/speculative/).
They are appended one at a time with the finish checks after each, so a multi-token commit ends exactly where
one-at-a-time decoding would have: the token that reaches max_tokens / max_model_len, an EOS or stop id, or the
token whose text completes a stop string is kept, every token after it (and its logprob) is dropped. Check order
as vLLM: length limits, then (from min_tokens on) EOS, stop token ids, stop strings; a stop string found on the
token that also reaches max_tokens reports "stop" (as vLLM v1). A request with a grammar (so_args) advances its matcher with each token
first; a token the grammar refuses (drawn only when no token was legal) is dropped and ends the request with
"grammar_dead_end"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .scheduler.request import Request


@dataclass(frozen=True)
class Detokenizer:
    """Output ids -> text. prefix_stable: decode(a + b) == decode(a) + decode(b) whenever decode(a) does not end in
    U+FFFD, as for a byte-level BPE decoder: `tokenizers` joins the bytes of each run of ordinary tokens and decodes
    the run as UTF-8 with replacement (an added token's text goes between runs as it is; a skipped special token
    does not split a run), so text before a complete character never changes when tokens are appended. Then stop
    strings are scanned on text decoded incrementally, each token's bytes once, instead of the whole output per
    token (at 1024 output tokens the whole-output decode was ~0.2 ms a row per step on the CI CPU)."""
    decode: Callable[[list[int]], str]
    prefix_stable: bool = False

    def __call__(self, ids: list[int]) -> str:
        return self.decode(ids)


def byte_level(tokenizer) -> bool:
    """Whether a `tokenizers.Tokenizer` decodes byte-level (Detokenizer.prefix_stable holds)."""
    from tokenizers import decoders
    return isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int]], str], eos_token_id: int | None, max_model_len: int):
        """decode: output ids -> text (a Detokenizer says whether text may be decoded incrementally)."""
        self.decode, self.eos_token_id, self.max_model_len = decode, eos_token_id, max_model_len
        self.prefix_stable = isinstance(decode, Detokenizer) and decode.prefix_stable

    def commit(self, r: Request, tokens: list[int], logprobs: list[dict | None], now: float) -> int:
        """Append a row's committed tokens (with their logprob entries, None where not asked); returns how many
        were kept (fewer than given when one of them finished the request)."""
        for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if r.grammar is not None and not r.grammar.accept(tok):
                r.finish_reason = "grammar_dead_end"      # sampled only when no token was legal (all -inf)
                r.metrics.finished_time = now
                return i
            self._append(r, tok, lp, now)
            if r.finish_reason is not None:
                r.metrics.finished_time = now
                return i + 1
        return len(tokens)

    def record_prompt_logprobs(self, r: Request, entries: list[dict]) -> None:
        """Append a prompt piece's prompt-logprob entries (the first prompt token has none: None, as vLLM)."""
        if r.prompt_logprobs is None:
            r.prompt_logprobs = [None]
        r.prompt_logprobs.extend(entries)

    def text(self, r: Request) -> str:
        """The output text; a matched stop string and what follows it are not part of it (vLLM's default)."""
        text = self.decode(r.output_ids)
        return text if r.stop_at is None else text[:r.stop_at]

    # ---- one token ----
    def _append(self, r: Request, tok: int, lp: dict | None, now: float) -> None:
        r.output_ids.append(tok)
        if lp is not None:
            r.logprobs = r.logprobs if r.logprobs is not None else []
            r.logprobs.append(lp)
        r.metrics.first_token_time = r.metrics.first_token_time or now
        r.metrics.token_times.append(now)                  # one per committed token
        p, n_out = r.params, len(r.output_ids)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or r.num_tokens >= self.max_model_len:
            r.finish_reason = "length"
        elif n_out >= p.min_tokens:
            if tok == self.eos_token_id and not p.ignore_eos:
                r.finish_reason = "stop"
            elif tok in p.stop_token_ids:
                r.finish_reason, r.stop_reason = "stop", tok
        if p.stop:
            self._check_stop_strings(r, n_out >= p.min_tokens and r.finish_reason != "stop")

    def _check_stop_strings(self, r: Request, active: bool) -> None:
        """Find the earliest stop string in the text the new token added (a match may start up to
        len(stop) - 1 characters earlier, never earlier: text already scanned had no match); text produced
        before min_tokens is scanned but never matched."""
        text = self._text_so_far(r)
        if active:
            hits = [(i, s) for s in r.params.stop if (i := text.find(s, max(0, r.stop_checked - len(s) + 1))) >= 0]
            if hits:
                r.stop_at, r.stop_reason = min(hits)
                r.finish_reason = "stop"
        r.stop_checked = len(text)

    def _text_so_far(self, r: Request) -> str:
        """decode(r.output_ids). Prefix-stable: the text of the tokens before r.detok_tokens is kept (r.detok_text)
        and only the tokens after it are decoded; the kept part moves up to the end whenever the new text does not
        end in U+FFFD (a character whose bytes are not all there yet)."""
        if not self.prefix_stable:
            return self.decode(r.output_ids)
        tail = self.decode(r.output_ids[r.detok_tokens:])
        text = r.detok_text + tail
        if not tail.endswith("\ufffd"):                  # (an empty tail: skipped special tokens)
            r.detok_tokens, r.detok_text = len(r.output_ids), text
        return text
