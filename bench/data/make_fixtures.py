"""Regenerate the shipped offline fixtures: `python -m bench.data.make_fixtures`.

- fixtures/imdb_tiny.jsonl: 400 IMDb-style reviews in the hub schema (`text`, `label`: 1 positive, 0 negative).
  Each review mixes neutral sentences with sentiment sentences, one of which may carry the opposite
  sentiment, so a model must weigh words rather than spot one.
- fixtures/squad_tiny_{train,validation}.jsonl: SQuAD v1.1-style examples (`id`, `title`, `context`,
  `question`, `answers: {text, answer_start}`) about fictional places, several gold answers per question;
  answer_start offsets are computed, never typed.
- vocab.txt: a WordPiece vocabulary with every fixture word, letters and digits (also as ## pieces).
Deterministic: the same files every time.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
POSITIVE = ["wonderful", "superb", "brilliant", "moving", "delightful", "excellent", "charming", "gripping",
            "beautiful", "funny", "touching", "masterful"]
NEGATIVE = ["terrible", "boring", "awful", "dull", "clumsy", "tedious", "painful", "weak", "lifeless",
            "forgettable", "annoying", "dreadful"]
NOUNS = ["acting", "story", "script", "soundtrack", "ending", "pacing", "direction", "cast", "dialogue",
         "photography", "plot", "lead performance"]
NEUTRAL = ["I watched it on a {day} evening with my {person}.", "The film runs for about {n} minutes.",
           "It was released in {year} and shot in {place}.", "My {person} had recommended it to me.",
           "We saw it at the local cinema near the {place}."]
SENTIMENT = ["The {noun} was {adj}.", "Honestly, the {noun} felt {adj}.", "I found the {noun} {adj}.",
             "What a {adj} {noun}.", "Overall it was a {adj} film."]
FILL = {"day": ["monday", "friday", "sunday", "rainy"], "person": ["sister", "friend", "father", "neighbour"],
        "n": ["ninety", "two hundred", "one hundred and twenty"], "year": ["1994", "2003", "2011", "2019"],
        "place": ["harbour", "old station", "mountains", "city centre"]}


def _fill(template: str, rng: random.Random, **fixed) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: fixed.get(m.group(1)) or rng.choice(FILL[m.group(1)]), template)


def imdb(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        label = i % 2
        own, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        sentences = [_fill(rng.choice(SENTIMENT), rng, noun=rng.choice(NOUNS), adj=rng.choice(own))
                     for _ in range(rng.randint(2, 3))]
        if rng.random() < 0.4:
            sentences.append(_fill(rng.choice(SENTIMENT), rng, noun=rng.choice(NOUNS), adj=rng.choice(other)))
        sentences += [_fill(rng.choice(NEUTRAL), rng) for _ in range(rng.randint(1, 3))]
        rng.shuffle(sentences)
        rows.append({"text": " ".join(sentences), "label": label})
    return rows


PLACES = ["Velmora", "Ostrand", "Kaleth", "Brisvaal", "Tormund", "Elsworth", "Quillan", "Darrow", "Fenmark",
          "Ysolde", "Harrowgate", "Mirewood", "Caldera", "Lunwick", "Pellam", "Stavros", "Thornbury", "Wexley",
          "Arlmont", "Corvane", "Dunmere", "Glenrock", "Ivorhal", "Jastow", "Kirnan", "Lorimer", "Marlow",
          "Norwick", "Orrin", "Pryce", "Redhaven", "Selkirk", "Tavish", "Umber", "Varrow", "Wendle", "Yarrow",
          "Zennor", "Ashby", "Brookmere"]
KINDS = ["bridge", "library", "lighthouse", "museum", "observatory", "tower", "cathedral", "theatre"]
RIVERS = ["Amber", "Silver", "Crane", "Otter", "Heron", "Willow"]
BUILDERS = ["Mara Quell", "Tobias Renn", "Ilse Varga", "Oskar Lind", "Nadia Brook", "Felix Auder"]
MATERIALS = ["red granite", "white marble", "grey limestone", "dark oak"]


def _answers(context: str, texts: list[str]) -> dict:
    starts = [context.index(t) for t in texts]
    return {"text": texts, "answer_start": starts}


def squad(rng: random.Random) -> list[dict]:
    rows = []
    for i, place in enumerate(PLACES):
        kind, river = rng.choice(KINDS), rng.choice(RIVERS)
        builder, material = rng.choice(BUILDERS), rng.choice(MATERIALS)
        year = str(rng.randint(1700, 1990))
        name = f"{place} {kind.title()}"
        context = (f"The {name} is a {kind} on the banks of the {river} River. It was completed in {year} "
                   f"by the architect {builder}. The {kind} is made of {material} and is open to visitors "
                   f"every day except during the winter floods.")
        qas = [
            (f"When was the {name} completed?", [year, f"in {year}"]),
            (f"Who designed the {name}?", [builder, f"the architect {builder}"]),
            (f"What is the {name} made of?", [material, material.split()[1]]),
            (f"Which river is the {name} on?", [f"{river} River", f"the {river} River"]),
        ]
        for j, (question, texts) in enumerate(qas):
            rows.append({"id": f"{i:03d}{j}", "title": name, "context": context, "question": question,
                         "answers": _answers(context, list(dict.fromkeys(texts)))})
    return rows


def vocabulary(texts: list[str]) -> list[str]:
    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    pieces = [c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *pieces, *(f"##{c}" for c in pieces),
            *(w for w in words if w not in pieces)]


def main() -> None:
    rng = random.Random(20231)
    reviews = imdb(400, rng)
    qa = squad(rng)
    fixtures = HERE / "fixtures"
    fixtures.mkdir(exist_ok=True)
    write = lambda name, rows: (fixtures / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    write("imdb_tiny.jsonl", reviews)
    write("squad_tiny_train.jsonl", qa[:120])
    write("squad_tiny_validation.jsonl", qa[120:])
    texts = [r["text"] for r in reviews] + [r["context"] + " " + r["question"] for r in qa]
    (HERE / "vocab.txt").write_text("\n".join(vocabulary(texts)) + "\n")


if __name__ == "__main__":
    main()
