"""Writes the offline eval data the project owns (eval/tasks/data/*.jsonl): seeded, so rerunning gives the same
bytes. `python -m deepinfer.evals.tasks.make_data` (or `python eval/tasks/make_data.py`).

arith.jsonl  generate_until: "What is a + b?" with the sum as the answer
choice.jsonl multiple choice: which of four numbers is the largest
text.jsonl   loglikelihood_rolling: short templated passages (perplexity)
json.jsonl   generate_until with a JSON-schema grammar: a person's record (name, age, city) as JSON
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SUBJECTS = ["The river", "A small bird", "The old clock", "My neighbour", "The north wind", "A quiet train"]
VERBS = ["crossed", "watched", "remembered", "carried", "followed", "painted"]
OBJECTS = ["the valley", "a red lantern", "the morning light", "an empty road", "the harbour", "a paper boat"]
ENDINGS = ["before dawn.", "after the rain.", "for a long time.", "without a sound.", "every summer.",
           "at the edge of town."]


def arith(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"id": i, "question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def choice(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        nums = rng.sample(range(1, 100), 4)
        rows.append({"id": i, "question": "Which number is the largest?", "choices": [str(x) for x in nums],
                     "label": nums.index(max(nums))})
    return rows


def text(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
                     for _ in range(rng.randint(2, 4))]
        rows.append({"id": i, "text": " ".join(sentences)})
    return rows


NAMES = ["Ada", "Boris", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun"]
CITIES = ["Paris", "Lima", "Oslo", "Seoul", "Accra", "Quito"]        # deepinfer_json.yaml's schema enum


def record(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        fields = {"name": rng.choice(NAMES), "age": rng.randint(18, 90), "city": rng.choice(CITIES)}
        rows.append({"id": i, "question": f"{fields['name']} is {fields['age']} and lives in {fields['city']}.",
                     "answer": json.dumps(fields), "fields": fields})
    return rows


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for name, make, n in (("arith", arith, 200), ("choice", choice, 200), ("text", text, 100),
                          ("json", record, 100)):
        rows = make(random.Random(f"deepinfer-{name}"), n)
        (DATA / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
