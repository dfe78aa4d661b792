"""DeepSeek-V4.1 Engram: an n-gram hash memory written into the hc residual streams.

Three pieces, all in the reference's exact arithmetic (docs/engram.md has the derivation):

* ``compressed_token_map``: token id -> compressed id (tokens that normalize alike share one id).
* ``EngramHasher``: the hash of the 2..N-grams ending at each new token, per engram layer, into
  prime-sized bucket ranges of that layer's table. Stateful per sequence through a tiny tensor
  (the last N-1 compressed ids), so it fits the flat-batch engine; no [B, max_seq] history.
* ``Engram``: the module of one engram layer (checkpoint names ``engram.embed.weight``,
  ``engram.wkv``, ``engram.q_weight``, ``engram.k_weight``) that gathers the hashed rows and
  adds a gated value to every stream.

Importable without transformers: the tokenizer side uses the ``tokenizers`` library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from deepinfer.config.engram_layout import engram_prime_layout
from deepinfer.kernels.rowwise import rowwise
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.quant import dequantize_fp8_blocks

from ..common.layers import Linear

# A compressed-id marker: "no token here" (before the sequence start, or a DEAD position such as an
# image-span token). The slot holding it and every farther look-back slot hash as map[pad_id].
BLOCKED = -1
# The gate's floor under |dot| before the signed square root.
GATE_CLAMP = 1e-6
# Tokens decoded alone that contain this are partial UTF-8 byte tokens.
_REPLACEMENT_CHAR = "\ufffd"
# A private-use character that carries a lone space through Strip().
_SPACE_SENTINEL = "\ue000"


# --------------------------------------------------------------------------- compressed token map

def _load_tokenizer(tokenizer):
    from tokenizers import Tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        return Tokenizer.from_file(path)
    # A transformers fast tokenizer wraps the Rust one; use the raw backend, as the reference does.
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def _compression_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),   # a text that is exactly one space ...
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),             # ... survives the strip as " "
    ])


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> compressed id, and the compressed vocab size.

    ``tokenizer``: a path to ``tokenizer.json`` (or its directory), a ``tokenizers.Tokenizer``, or
    anything with a ``backend_tokenizer`` (a transformers fast tokenizer). Each id is decoded alone
    by the raw backend with specials kept. A text containing U+FFFD (a partial UTF-8 byte token)
    is keyed by the raw token string; any other is normalized (NFKC, NFD, strip accents, lowercase,
    whitespace runs -> one space, a lone space kept, strip) and an empty result falls back to the
    text itself. Compressed ids are handed out in order of first appearance over ascending ids.
    """
    backend = _load_tokenizer(tokenizer)
    normalizer = _compression_normalizer()
    n = backend.get_vocab_size(with_added_tokens=True)   # == len() of the transformers tokenizer
    key_to_id: dict[str, int] = {}
    lookup = [0] * n
    for token_id in range(n):
        text = backend.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHAR in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


# --------------------------------------------------------------------------- bucket layout

def bucket_offsets(layer_primes: Sequence[Sequence[int]]) -> list[int]:
    """Start row of each (order, head) column inside one layer's table, order-major then head."""
    offsets, total = [], 0
    for order in layer_primes:
        for p in order:
            offsets.append(total)
            total += p
    return offsets


def hash_multipliers(layer_ids: Sequence[int], max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """int64 [n_layers, max_ngram]: odd multipliers from numpy's default_rng(10007 * layer_id), bounded so
    that compressed id * multiplier never overflows int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for layer_id in layer_ids]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, max_ngram), dtype=np.int64)


def engram_layout(cfg) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket sizes ``[layer][order][head]`` (config.engram_layout.engram_prime_layout), checked against
    ``cfg.engram_num_embeddings`` when that is given."""
    primes = tuple(tuple(tuple(o) for o in layer) for layer in engram_prime_layout(
        cfg.engram_vocab_size, len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads))
    rows = tuple(sum(sum(o) for o in layer) for layer in primes)
    if cfg.engram_num_embeddings and tuple(cfg.engram_num_embeddings) != rows:
        raise ValueError(f"engram_num_embeddings {tuple(cfg.engram_num_embeddings)} do not match the prime layout "
                         f"of engram_vocab_size={cfg.engram_vocab_size}, {len(cfg.engram_layer_ids)} layers, "
                         f"{cfg.engram_max_ngram_size}-gram, {cfg.engram_n_heads} heads: {rows}")
    return primes


def engram_num_embeddings(cfg) -> tuple[int, ...]:
    """Table rows per engram layer (the config's values, else derived from the layout)."""
    if cfg.engram_num_embeddings:
        return tuple(cfg.engram_num_embeddings)
    return tuple(sum(sum(o) for o in layer) for layer in engram_layout(cfg))


# --------------------------------------------------------------------------- hashing

@dataclass
class _HashTables:
    token_map: torch.Tensor     # int64 [vocab]: compressed id, BLOCKED past the tokenizer's ids
    multipliers: torch.Tensor   # int64 [L, M]
    primes: torch.Tensor        # int64 [L, M-1, H]
    offsets: torch.Tensor       # int64 [L, (M-1)*H]

    def to(self, device: torch.device) -> "_HashTables":
        return _HashTables(*(t.to(device) for t in (self.token_map, self.multipliers, self.primes, self.offsets)))


class EngramHasher:
    """Hash ids of the engram layers, per sequence, incrementally.

    State of a sequence: int64 [max_ngram - 1], the compressed ids of its last max_ngram - 1 tokens,
    oldest first, ``BLOCKED`` for "before the start" or a DEAD token (``new_state()`` is all BLOCKED).
    The state depends only on the sequence's last max_ngram - 1 tokens, so after a rollback it is
    rebuilt exactly by ``state_for(tokens[-(max_ngram-1):])``, or by ``state_for(tokens)``.
    """

    def __init__(self, cfg, token_map: Sequence[int]):
        if not cfg.engram_layer_ids:
            raise ValueError("the config has no engram layers")
        size = max(token_map) + 1
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer's compressed vocab has {size} ids, the config says "
                             f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}: every hash "
                             "multiplier depends on it, so the engram tables would be read at wrong rows")
        if not 0 <= cfg.engram_pad_id < len(token_map):
            raise ValueError(f"engram_pad_id={cfg.engram_pad_id} is not a token id of the tokenizer")
        self.layer_ids = tuple(cfg.engram_layer_ids)
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.compressed_vocab_size = size
        self.pad = int(token_map[cfg.engram_pad_id])
        self.primes = engram_layout(cfg)
        self.num_embeddings = tuple(sum(sum(o) for o in layer) for layer in self.primes)
        # Ids the model may emit past the tokenizer (a padded embedding) have no text: they hash as DEAD.
        # (The reference has no defined behaviour for them; every id it accepts hashes identically.)
        lookup = torch.full((max(len(token_map), cfg.vocab_size),), BLOCKED, dtype=torch.int64)
        lookup[:len(token_map)] = torch.tensor(list(token_map), dtype=torch.int64)
        self._cpu = _HashTables(
            token_map=lookup,
            multipliers=torch.from_numpy(hash_multipliers(self.layer_ids, self.max_ngram, size)),
            primes=torch.tensor(self.primes, dtype=torch.int64),
            offsets=torch.tensor([bucket_offsets(layer) for layer in self.primes], dtype=torch.int64),
        )
        self._tables = {torch.device("cpu"): self._cpu}

    @classmethod
    def from_tokenizer(cls, cfg, tokenizer) -> "EngramHasher":
        lookup, _ = compressed_token_map(tokenizer)
        return cls(cfg, lookup)

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def multipliers(self) -> torch.Tensor:
        return self._cpu.multipliers

    @property
    def offsets(self) -> torch.Tensor:
        return self._cpu.offsets

    def tables(self, device: torch.device | str) -> _HashTables:
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = self._cpu.to(device)
        return self._tables[device]

    def new_state(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.full((self.max_ngram - 1,), BLOCKED, dtype=torch.int64, device=device)

    def state_for(self, token_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """The state after a whole sequence ``token_ids`` [T] (with its DEAD mask)."""
        return self.hash_ids(token_ids, self.new_state(token_ids.device), dead)[1]

    def hash_ids(self, token_ids: torch.Tensor, state: torch.Tensor, dead: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: new tokens [T] after ``state`` -> (hash ids int64 [T, L, C], the new state)."""
        ids, states = self.hash_ids_flat(token_ids, [(0, token_ids.numel())], [state], dead)
        return ids, states[0]

    def hash_ids_flat(self, input_ids: torch.Tensor, chunks: Sequence[tuple[int, int]],
                      states: Sequence[torch.Tensor], dead: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Flat batch: ``input_ids`` [N], sequence i owning rows ``chunks[i] = (start, end)`` (the chunks
        cover all N rows) and entering with ``states[i]``; ``dead`` [N] bool marks DEAD tokens (None:
        text only). Returns hash ids int64 [N, L, C] (columns order-major then head, each already offset
        into its layer's table) and the new states. The given states are not modified."""
        device = input_ids.device
        k, m = self.max_ngram - 1, self.max_ngram
        comp = self.compressed(input_ids)
        if dead is not None:
            comp = comp.masked_fill(dead.to(device=device, dtype=torch.bool), BLOCKED)
        # ext = [state_0, new_0, state_1, new_1, ...]; new row r sits at ext[where[r]].
        pieces, where, new_ends, off = [], torch.empty(input_ids.numel(), dtype=torch.int64), [], 0
        for (s, e), st in zip(chunks, states):
            pieces += [st.to(device=device, dtype=torch.int64), comp[s:e]]
            where[s:e] = torch.arange(off + k, off + k + e - s)
            off += k + e - s
            new_ends.append(off)
        ext = torch.cat(pieces)
        new_states = [ext[end - k:end].clone() for end in new_ends]
        window = ext[where.to(device).unsqueeze(1) - torch.arange(m, device=device)]          # [N, M]: t, t-1, ...
        return self.hash_window(window), new_states

    def compressed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> compressed ids [...] (int64; BLOCKED past the tokenizer's ids)."""
        return self.tables(token_ids.device).token_map[token_ids.long()]

    def hash_window(self, window: torch.Tensor) -> torch.Tensor:
        """Compressed ids [N, M] of each new token and its look-back, newest first (t, t-1, ..., BLOCKED where
        none) -> hash ids int64 [N, L, C]. No host synchronisation (the runtime forward calls it directly)."""
        t = self.tables(window.device)
        m = self.max_ngram
        blocked = (window == BLOCKED).cumsum(dim=1) > 0          # a gap blocks its slot and every farther one
        tokens = window.masked_fill(blocked, self.pad)
        products = tokens.unsqueeze(1) * t.multipliers                                          # [N, L, M]
        rolling, cols = products[..., 0], []
        for n in range(1, m):
            rolling = rolling ^ products[..., n]                                               # the (n+1)-gram
            cols.append(rolling.unsqueeze(-1) % t.primes[:, n - 1])                            # [N, L, H]
        return torch.cat(cols, dim=-1) + t.offsets


# --------------------------------------------------------------------------- the module

def dequantize_engram_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                           block: int = 32) -> torch.Tensor:
    """On-disk table rows -> the module's ``embed.weight`` rows: FP8 e4m3 [R, hd] times one scale per
    ``block`` channels ([R, hd / block], E8M0 or float). Exact in bf16 and wider. Works on any row slice,
    so a loader can fold a large table chunk by chunk."""
    if weight.dtype != torch.float8_e4m3fn:
        return weight.to(dtype)
    return dequantize_fp8_blocks(weight, scale, (1, block), dtype)      # FP8 blocks of one row x `block`


class EngramEmbedding(nn.Module):
    """The hash table, already dequantized (the checkpoint's ``embed.scale`` is folded in by the loader;
    see dequantize_engram_rows). ``forward`` is the only read of the table: a row gather, which is where
    an mmap / offloaded table would plug in (docs/engram.md)."""

    def __init__(self, num_embeddings: int, head_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings, self.head_dim = num_embeddings, head_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim, dtype=dtype), requires_grad=False)

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """hash ids [..., C] -> rows [..., C, head_dim]."""
        return nn.functional.embedding(hash_ids, self.weight)


class Engram(nn.Module):
    """One engram layer: gather the hashed rows, project to one key per hc stream plus a shared value,
    gate each stream by a normalized (stream . key) match, add gate * value."""

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype | None = None,
                 num_embeddings: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.layer_index = cfg.engram_layer_ids.index(layer_id)     # column of EngramHasher's [N, L, C]
        self.hidden_size, self.hc_mult = cfg.hidden_size, cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        rows = num_embeddings if num_embeddings is not None else engram_num_embeddings(cfg)[self.layer_index]
        self.embed = EngramEmbedding(rows, cfg.engram_head_dim, dtype)
        self.wkv = Linear(n_cols * cfg.engram_head_dim, cfg.hidden_size * (cfg.hc_mult + 1), dtype)
        self.q_weight = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, dead: torch.Tensor | None = None
                ) -> torch.Tensor:
        """streams [N, hc, D], hash_ids [N, C] (this layer's slice), dead [N] bool or None (True: gate 0,
        the stream passes unchanged) -> streams [N, hc, D] in the input dtype. Row-local (kernels.rowwise)."""
        return rowwise(self._forward, streams, hash_ids, dead)

    def _forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        hc, d = self.hc_mult, self.hidden_size
        kv = self.wkv(self.embed(hash_ids).flatten(-2))
        key, value = kv.split([hc * d, d], dim=-1)
        key = upcast(key).unflatten(-1, (hc, d))
        weight = upcast(self.q_weight) * upcast(self.k_weight)      # only ever used as a product
        h = upcast(streams)
        # normalized per (token, stream) over D
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * d ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if dead is not None:
            gate = gate.masked_fill(dead.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * upcast(value).unsqueeze(-2)).to(streams.dtype)
