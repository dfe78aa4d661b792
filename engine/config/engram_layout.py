"""The Engram tables' bucket layout: prime-sized bucket ranges per (layer, n-gram order, head), which fix the
tables' row counts (config) and the hash's moduli (models/deepseek_v41/engram.py)."""

from __future__ import annotations


def engram_prime_layout(vocab_size: int, n_layers: int, max_ngram: int, n_heads: int) -> list[list[list[int]]]:
    """Bucket sizes [layer][n-gram order 2..max_ngram][head] of the Engram tables: for every layer and order, restart
    at `vocab_size - 1` and take the next `n_heads` primes that no earlier (layer, order, head) has taken."""
    from sympy import nextprime   # a torch dependency; imported here so config parsing never needs it otherwise

    taken: set[int] = set()
    layout = []
    for _ in range(n_layers):
        orders = []
        for _ in range(max_ngram - 1):
            heads, p = [], vocab_size - 1
            for _ in range(n_heads):
                p = nextprime(p)
                while p in taken:
                    p = nextprime(p)
                taken.add(p)
                heads.append(int(p))
            orders.append(heads)
        layout.append(orders)
    return layout


def engram_table_rows(vocab_size: int, n_layers: int, max_ngram: int, n_heads: int) -> tuple[int, ...]:
    """Rows of each Engram layer's table: the sum of that layer's bucket primes."""
    return tuple(sum(map(sum, layer)) for layer in engram_prime_layout(vocab_size, n_layers, max_ngram, n_heads))
