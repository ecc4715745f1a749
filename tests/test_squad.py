"""SQuAD pre/post-processing round trip on the shipped fixtures, scored against hand-computed EM/F1."""

import datasets
import numpy as np
import pytest
from transformers import BertTokenizer

from bench.running.config import DATA_DIR
from bench.tasks.squad_processing import (
    exact_match_score,
    f1_score,
    postprocess_predictions,
    prepare_eval_features,
    prepare_train_features,
    squad_scores,
)

MAX_LENGTH, STRIDE = 48, 16  # short windows, so contexts overflow into several windows


@pytest.fixture(scope="module")
def data():
    tokenizer = BertTokenizer(vocab=str(DATA_DIR / "vocab.txt"))
    dev = datasets.load_dataset("json", data_files=str(DATA_DIR / "fixtures/squad_tiny_validation.jsonl"))["train"]
    dev = dev.select(range(8))
    features = dev.map(lambda ex: prepare_eval_features(ex, tokenizer, MAX_LENGTH, STRIDE), batched=True,
                       remove_columns=dev.column_names)
    return tokenizer, dev, features


def _logits_for(dev, features, spans: dict[str, tuple[int, int]]):
    """Logits that put all the mass on character span (start, end) of each example, in one window holding it."""
    n, length = len(features), len(features[0]["input_ids"])
    start, end = np.zeros((n, length)), np.zeros((n, length))
    for i, f in enumerate(features):
        char_start, char_end = spans[f["example_id"]]
        offsets = f["offset_mapping"]
        s = [k for k, o in enumerate(offsets) if o is not None and o[0] == char_start]
        e = [k for k, o in enumerate(offsets) if o is not None and o[1] == char_end]
        if s and e:
            start[i, s[0]], end[i, e[0]] = 10.0, 10.0
    return start, end


def test_windows_overlap_and_cover_every_context(data):
    _, dev, features = data
    assert len(features) > len(dev)  # contexts overflow the 48-token windows
    assert set(features["example_id"]) == set(dev["id"])


def test_gold_spans_score_100(data):
    _, dev, features = data
    spans = {ex["id"]: (ex["answers"]["answer_start"][0],
                        ex["answers"]["answer_start"][0] + len(ex["answers"]["text"][0])) for ex in dev}
    predictions = postprocess_predictions(dev, features, *_logits_for(dev, features, spans))
    assert predictions == {ex["id"]: ex["answers"]["text"][0] for ex in dev}
    assert squad_scores(dev, predictions) == {"exact_match": 100.0, "f1": 100.0}


def test_wrong_spans_score_what_the_hand_count_says():
    examples = [
        {"id": "a", "context": "It was completed in 1723 by Ilse Varga.",
         "answers": {"text": ["1723", "in 1723"], "answer_start": [20, 17]}},
        {"id": "b", "context": "the architect Ilse Varga",
         "answers": {"text": ["Ilse Varga", "the architect Ilse Varga"], "answer_start": [14, 0]}},
    ]
    # a: "in 1723" equals the second gold answer: EM 1, F1 1.
    # b: "architect Ilse" vs "Ilse Varga": P = R = 1/2, F1 = 0.5; vs "the architect Ilse Varga" (normalised
    #    "architect ilse varga"): P = 2/2, R = 2/3, F1 = 0.8; best 0.8. EM 0.
    scores = squad_scores(examples, {"a": "in 1723", "b": "architect Ilse"})
    assert scores["exact_match"] == pytest.approx(50.0)
    assert scores["f1"] == pytest.approx(90.0)


def test_train_features_point_at_the_first_gold_answer(data):
    tokenizer, dev, _ = data
    features = prepare_train_features(dev[:4], tokenizer, MAX_LENGTH, STRIDE)
    found = 0
    for ids, s, e in zip(features["input_ids"], features["start_positions"], features["end_positions"]):
        if s == 0:
            continue  # answer not fully inside this window: points at CLS
        found += 1
        span = tokenizer.decode(ids[s:e + 1])
        assert span in {t.lower() for ex in dev.select(range(4)) for t in ex["answers"]["text"]}
    assert found >= 4


# (prediction, gold answers, exact match, F1) by hand with evaluate-v1.1.py's rules: lower case, ASCII punctuation
# removed, articles removed, whitespace squeezed; F1 = 0 when no token is shared, also when both sides are empty.
OFFICIAL_CASES = [
    ("", ["Paris"], 0.0, 0.0),                                  # empty prediction
    ("   ", ["Paris"], 0.0, 0.0),                               # whitespace only
    ("the", ["a"], 1.0, 0.0),                                   # both normalise to "": EM 1, F1 0 (2.0's rule: 1)
    ("...", ["The.", "an"], 1.0, 0.0),                          # punctuation and articles only, two golds
    ("", ["!?"], 1.0, 0.0),                                     # empty against punctuation-only gold
    ("Paris\u2014France", ["Paris France"], 0.0, 0.0),          # an em dash is not ASCII punctuation: one token
    ("\u201cParis\u201d", ["Paris"], 0.0, 0.0),                  # curly quotes stay part of the token
    ("Paris,  France!", ["paris france"], 1.0, 1.0),
    ("the the cat sat", ["cat sat on the mat"], 0.0, 2 / 3),    # P 2/2, R 2/4
    ("x y y", ["y y y z"], 0.0, 2 * (2 / 3 * 1 / 2) / (2 / 3 + 1 / 2)),  # repeated tokens count min(2, 3)
    ("in 1723", ["1723", "in 1723"], 1.0, 1.0),                  # best over several golds
    ("architect Ilse", ["Ilse Varga", "the architect Ilse Varga"], 0.0, 0.8),
]


@pytest.mark.parametrize("prediction,golds,em,f1", OFFICIAL_CASES)
def test_each_example_scores_as_the_official_v11_scorer(prediction, golds, em, f1):
    assert max(exact_match_score(prediction, g) for g in golds) == em
    assert max(f1_score(prediction, g) for g in golds) == pytest.approx(f1, abs=1e-15)


def test_the_overall_scores_average_the_official_per_example_scores():
    examples = [{"id": str(i), "answers": {"text": golds, "answer_start": [0] * len(golds)}}
                for i, (_, golds, _, _) in enumerate(OFFICIAL_CASES)]
    predictions = {str(i): p for i, (p, _, _, _) in enumerate(OFFICIAL_CASES)}
    scores = squad_scores(examples, predictions)
    n = len(OFFICIAL_CASES)
    assert scores["exact_match"] == pytest.approx(100 * sum(c[2] for c in OFFICIAL_CASES) / n, abs=1e-12)
    assert scores["f1"] == pytest.approx(100 * sum(c[3] for c in OFFICIAL_CASES) / n, abs=1e-12)


def test_torchmetrics_agrees_except_where_both_sides_normalise_to_nothing():
    """The independent scorer users reach for: the same numbers wherever v1.1 and 2.0 rules coincide."""
    from torchmetrics.functional.text import squad as tm_squad

    for i, (prediction, golds, em, f1) in enumerate(OFFICIAL_CASES):
        theirs = tm_squad({"prediction_text": prediction, "id": str(i)},
                          {"answers": {"text": golds, "answer_start": [0] * len(golds)}, "id": str(i)})
        assert float(theirs["exact_match"]) == pytest.approx(100 * em)
        if em == 1.0 and f1 == 0.0:  # the no-answer rule: torchmetrics gives F1 100, v1.1 gives 0
            assert float(theirs["f1"]) == pytest.approx(100.0)
        else:
            assert float(theirs["f1"]) == pytest.approx(100 * f1)
