"""Structured outputs through xgrammar: `SamplingParams(so_args={"schema_type": ..., "schema": ...})`.

    schema_type "regex"           schema: a regular expression the whole output must match
                "json"            schema: a JSON-schema dict or its JSON text (the output is one JSON value of it)
                "ebnf"            schema: an EBNF grammar in xgrammar's (GBNF) syntax, rule `root` first
                "structural_tag"  schema: xgrammar's structural-tag format (a dict or its JSON text): free text
                                  until a trigger, then a schema-constrained body (tool calls)

Per engine, `Grammars` holds xgrammar's view of the tokenizer (built once) and compiles each distinct schema
once (a cache keyed by (schema_type, schema text)) on xgrammar's compiler threads, in a thread pool, so several
requests' grammars compile at once. Per request a `RequestGrammar` holds one matcher:
  - before each sampling step the runner fills the row's bitmask of legal next tokens and sets every other
    logit to -inf before penalties, temperature, top-k / top-p and the draw (kernels of xgrammar on the logits'
    device); unconstrained rows are untouched, so their draws are the same bits as without any constraint;
  - the output processor advances it with each committed token; a token it refuses (only when no legal token
    existed: every logit was -inf) ends the request with finish_reason "grammar_dead_end";
  - `rollback(k)` undoes the last k accepted tokens (for rejected speculative tokens).
Once the output is complete the stop token (EOS) is legal (the only legal one when nothing may follow), and
drawing it ends the request with "stop".

Known limit (xgrammar 0.2.9): a string with maxLength / minLength compiles to `[^"\\\r\n]{m,n}`, which admits
raw control characters (strict JSON parsers refuse them: `json.loads(text, strict=False)` reads them) and no
escapes; unbounded strings exclude control characters as JSON requires.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .errors import DeepInferError

CACHE_BYTES = 256 << 20    # compiled grammars kept (least recently used dropped past this; matchers keep theirs)
CACHE_ENTRIES = 1024       # and at most this many
JSON_MAX_WHITESPACE = 20   # whitespace characters allowed in a row between JSON tokens (indented output fits; a
                           # model cannot stall in whitespace forever, which unbounded runs let random models do)
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")      # "[21:44:17] /project/cpp/x.cc:94: " on xgrammar errors


def schema_text(so_args: dict) -> str:
    """The cache key's text of a canonical so_args: the schema as given (str) or json.dumps of the dict, keys in
    their order (a JSON schema's property order is the output's), so a dict and its json.dumps text share one
    compiled grammar."""
    schema = so_args["schema"]
    return schema if isinstance(schema, str) else json.dumps(schema)


def _message(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(err).__name__


class Grammars:
    """xgrammar's tokenizer info and compiler for one engine, and its compiled grammars by schema."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int = 4,
                 cache_bytes: int = CACHE_BYTES):
        """tokenizer: a `tokenizers.Tokenizer` (the checkpoint's); vocab_size: the model's logits width (>= the
        tokenizer's: the rows past it are never legal); stop_token_ids: the tokens that end a complete output;
        cache_bytes: the compiled grammars kept, least recently used dropped first (xgrammar's own cache is
        off: this one is the cache)."""
        try:
            import xgrammar as xgr
        except ImportError:
            raise DeepInferError("so_args (structured outputs) needs the xgrammar package: pip install "
                                 "xgrammar==0.2.9") from None
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # special tokens as "": xgrammar then never allows them in the text (decoding drops them, so an output
        # holding one would not match its own grammar); the stop tokens still end a complete output
        encoded = [""] * vocab_size
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in special:
                encoded[i] = token
        self.info = xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                                      stop_token_ids=stop_token_ids, add_prefix_space=detected.add_prefix_space)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.cache_bytes = int(cache_bytes)
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()   # least recently used first
        self.masks = MaskBuffer(xgr)

    def submit(self, so_args: dict) -> Future:
        """The compiled grammar of canonical so_args (SamplingParams' form), compiled once per distinct schema
        while it stays in the cache."""
        key = (so_args["schema_type"], schema_text(so_args))
        fut = self._compiled.get(key)
        if fut is None:
            self._evict()
            fut = self._compiled[key] = self.pool.submit(self._compile, *key)
        self._compiled.move_to_end(key)
        return fut

    def _evict(self) -> None:
        """Drop the least recently used finished compiles while the cache holds over cache_bytes or
        CACHE_ENTRIES grammars (a failed compile counts as an entry of no bytes)."""
        def size(f: Future) -> int:
            return 0 if f.cancelled() or f.exception() is not None else f.result().memory_size_bytes
        done = [k for k, f in self._compiled.items() if f.done()]          # least recently used first
        total = sum(size(self._compiled[k]) for k in done)
        for key in done:
            if total <= self.cache_bytes and len(self._compiled) < CACHE_ENTRIES:
                break
            total -= size(self._compiled.pop(key))

    def _compile(self, schema_type: str, text: str):
        c = self.compiler
        if schema_type == "regex":
            return c.compile_regex(text)
        if schema_type == "json":
            return c.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if schema_type == "ebnf":
            return c.compile_grammar(text)
        return c.compile_structural_tag(text)

    def compiled(self, label: str, so_args: dict, future: Future | None = None):
        """The compiled grammar (waits for it: `future`, from an earlier submit, else submitted now); a schema
        xgrammar refuses is one DeepInferError line naming the request (`label`) and quoting the compiler."""
        try:
            return (future or self.submit(so_args)).result()
        except Exception as err:   # noqa: BLE001  xgrammar raises RuntimeError / ValueError with the reason
            raise DeepInferError(f"{label}: so_args {so_args['schema_type']} schema does not compile: "
                                 f"{_message(err)}") from None

    def matcher(self, compiled) -> "RequestGrammar":
        """A new matcher (one per request) over a compiled grammar."""
        return RequestGrammar(self.xgr.GrammarMatcher(compiled), self)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher, advanced from its committed tokens only."""

    def __init__(self, matcher, grammars: Grammars):
        self.matcher, self.grammars = matcher, grammars

    def accept(self, token: int) -> bool:
        """Advance by one committed token; False when the grammar does not allow it (the matcher unchanged)."""
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an xgrammar bitmask [rows, ceil(V / 32)] int32: the legal next tokens."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def ended(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts after the committed ones) the grammar allows in a row, up to its stop token;
        the matcher is left as it was."""
        n = 0
        while n < len(tokens) and not self.ended() and self.accept(tokens[n]):
            n += 1
        self.rollback(n)
        return n


class MaskBuffer:
    """One engine's host bitmask [rows, ceil(V / 32)] int32, reused every step: pinned when the logits are on a
    GPU, so its copy is asynchronous; the next step's fill waits for the previous copy to have left it. Rows are
    filled one at a time on the engine's thread: on the H200 at batch 64, xgrammar's BatchGrammarMatcher with 8
    threads took longer per step (1.02 vs 0.78 ms) and cost 11 points more TPOT (docs/structured-outputs.md).
    `fills` / `fill_seconds` count the steps that filled and the host time they took (fill, copy launch and the
    masking kernel's launch)."""

    def __init__(self, xgr):
        self.xgr, self.host, self.copied = xgr, None, None
        self.fills, self.fill_seconds = 0, 0.0

    def apply(self, logits: torch.Tensor, grammars: list, drafts: list | None = None) -> None:
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        t0 = time.perf_counter()
        m, v = logits.shape
        cuda = logits.device.type == "cuda"
        if self.host is None or self.host.shape[0] < m or self.host.shape[1] != (v + 31) // 32:
            self.host = torch.empty(max(m, 64), (v + 31) // 32, dtype=torch.int32, pin_memory=cuda)
        elif self.copied is not None:
            self.copied.synchronize()           # the previous step's copy has read the buffer
        bitmask = self.host[:m]                 # rows not in `rows` are never read (indices below)
        _fill_after_drafts(bitmask, rows, grammars, drafts or [[]] * m)
        if cuda:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(logits.device))    # the copy's stream (cuda:N)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        self.fills += 1
        self.fill_seconds += time.perf_counter() - t0


def _fill_after_drafts(bitmask: torch.Tensor, rows: list[int], grammars: list, drafts: list) -> None:
    """Row i's mask is that of grammars[i] after accepting drafts[i] (the drafts a verify row fed before its
    logit row i; a request's rows are consecutive, each one draft longer): each matcher walks its drafts once and
    is rolled back to its committed state. A draft the grammar refuses (speculation's plan trims them, so only as
    a safeguard) leaves the rows after it with the last legal state's mask, and the row after a stop-token draft
    allows every token: finite logits for rows that are never committed."""
    cur, depth = None, 0
    for i in rows:
        g, before = grammars[i], drafts[i]
        if g is not cur:
            if cur is not None:
                cur.rollback(depth)
            cur, depth = g, 0
        while depth < len(before) and not g.ended() and g.accept(before[depth]):
            depth += 1
        if g.ended():                         # after a stop-token draft: a row the request never commits
            bitmask[i] = -1
        else:
            g.fill(bitmask, i)                # a refused draft is refused again: later rows keep this mask
    if cur is not None:
        cur.rollback(depth)


def apply_grammar_masks(logits: torch.Tensor, grammars: list[RequestGrammar | None], drafts: list | None = None
                        ) -> None:
    """logits [M, V] in place: row i keeps only the tokens grammars[i] allows (None: the row is untouched), after
    the drafts drafts[i] (a verify row's logit rows: the drafts fed before each; None: no drafts)."""
    first = next((g for g in grammars if g is not None), None)
    if first is not None:
        first.grammars.masks.apply(logits, grammars, drafts)


__all__ = ["Grammars", "RequestGrammar", "apply_grammar_masks", "schema_text"]
