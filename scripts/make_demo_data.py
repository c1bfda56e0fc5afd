"""Regenerate the built-in demo data in trainer/demo_data/ (deterministic; committed output).

    python scripts/make_demo_data.py

Small templated tasks a tiny model learns in a few minutes on a CPU: arithmetic, word
reversal, counting, capitals and colours, as prompt/completion pairs, chat messages and
preference pairs, plus GSM8K-shaped math prompts for GRPO.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "trainer" / "demo_data"
WORDS = ["cat", "dog", "tree", "river", "stone", "cloud", "apple", "house", "light", "music",
         "bread", "green", "table", "water", "night", "paper", "smile", "train", "glass", "ocean"]
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
            "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Canada": "Ottawa", "Norway": "Oslo"}
COLOURS = {"grass": "green", "snow": "white", "the sky": "blue", "coal": "black", "a banana": "yellow",
           "a tomato": "red", "an orange": "orange", "a plum": "purple"}


def example(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        w = rng.choice(WORDS)
        return f"Spell the word {w} backwards.", f"{w} backwards is {w[::-1]}."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"How many letters are in the word {w}?", f"The word {w} has {len(w)} letters."
    if kind == 3:
        country = rng.choice(list(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    thing = rng.choice(list(COLOURS))
    return f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {COLOURS[thing]}."


def wrong(rng: random.Random, prompt: str, completion: str) -> str:
    """A fluent but wrong reply: the same sentence with its answer swapped."""
    words = completion.rstrip(".").split()
    answer = next((w for w in reversed(words) if w.isdigit()), words[-1])
    if answer.isdigit():
        cut = completion.rfind(answer)
        return completion[:cut] + str(int(answer) + rng.randrange(1, 5)) + completion[cut + len(answer):]
    pool = [w for w in list(CAPITALS.values()) + list(COLOURS.values()) + [w[::-1] for w in WORDS] if w != answer]
    return completion[: completion.rfind(answer)] + rng.choice(pool) + "."


def main() -> None:
    rng = random.Random(0)
    rows = [example(rng) for _ in range(1000)]
    with open(OUT / "sft.jsonl", "w") as fh:
        for prompt, completion in rows:
            fh.write(json.dumps({"prompt": prompt, "completion": " " + completion}) + "\n")
    with open(OUT / "chat.jsonl", "w") as fh:
        for i in range(0, 600, 2):
            (p1, c1), (p2, c2) = rows[i], rows[i + 1]
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": p1}, {"role": "assistant", "content": c1},
                        {"role": "user", "content": p2}, {"role": "assistant", "content": c2}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    with open(OUT / "preferences.jsonl", "w") as fh:
        for prompt, completion in rows[:600]:
            fh.write(json.dumps({"prompt": prompt, "chosen": " " + completion,
                                 "rejected": " " + wrong(rng, prompt, completion)}) + "\n")
    with open(OUT / "math.jsonl", "w") as fh:
        for row in math_prompts(rng):
            fh.write(json.dumps(row) + "\n")
    with open(OUT / "math_sft.jsonl", "w") as fh:
        for row in math_prompts(rng, 400):
            fh.write(json.dumps({"prompt": row["prompt"],
                                 "completion": [{"role": "assistant", "content": row["answer"]}]}) + "\n")
    with open(OUT / "math_eval.jsonl", "w") as fh:
        for row in math_prompts(rng, 40):
            fh.write(json.dumps(row) + "\n")


def math_prompts(rng: random.Random, n: int = 200) -> list[dict]:
    """GSM8K-shaped prompts (an `answer` column ending in `#### N`) for GRPO with exact-answer rewards."""
    rows = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}? End with #### and the number."}],
                     "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


if __name__ == "__main__":
    main()
