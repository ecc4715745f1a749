"""SQuAD pre- and post-processing as pure functions over batches (after Hugging Face's run_qa.py / utils_qa.py).

Pre-processing splits each (question, context) pair into windows of `max_length` tokens that overlap by
`doc_stride`, keeping the offset mapping so that token spans map back to characters of the context.
Post-processing scores every (start, end) pair among the n-best start and end logits of every window
of an example and keeps the best valid span (inside the context, end >= start, at most
`max_answer_length` tokens). Scoring is the official v1.1 scorer's, as pure functions.
"""

from __future__ import annotations

import collections
import math
import re
import string

import numpy as np

_PUNCTUATION = frozenset(string.punctuation)  # ASCII only, as the official script: unicode punctuation stays a token


def _tokenize(examples: dict, tokenizer, max_length: int, doc_stride: int):
    questions = [q.lstrip() for q in examples["question"]]
    return tokenizer(questions, examples["context"], truncation="only_second", max_length=max_length,
                     stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                     padding="max_length")


def prepare_train_features(examples: dict, tokenizer, max_length: int, doc_stride: int) -> dict:
    """Windows with `start_positions` / `end_positions` (token indices of the first gold answer; the CLS
    index 0 when the answer is not fully inside the window)."""
    enc = _tokenize(examples, tokenizer, max_length, doc_stride)
    starts, ends = [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        sequence_ids = enc.sequence_ids(i)
        answers = examples["answers"][enc["overflow_to_sample_mapping"][i]]
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        context = [k for k, s in enumerate(sequence_ids) if s == 1]
        first, last = context[0], context[-1]
        if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
            starts.append(0)
            ends.append(0)
            continue
        start = first
        while start <= last and offsets[start][0] <= start_char:
            start += 1
        end = last
        while end >= first and offsets[end][1] >= end_char:
            end -= 1
        starts.append(start - 1)
        ends.append(end + 1)
    enc.pop("offset_mapping")
    enc.pop("overflow_to_sample_mapping")
    return {**enc, "start_positions": starts, "end_positions": ends}


def prepare_eval_features(examples: dict, tokenizer, max_length: int, doc_stride: int) -> dict:
    """Windows with `example_id` and an offset mapping that is None outside the context."""
    enc = _tokenize(examples, tokenizer, max_length, doc_stride)
    example_ids, offset_mapping = [], []
    for i, sample in enumerate(enc["overflow_to_sample_mapping"]):
        sequence_ids = enc.sequence_ids(i)
        example_ids.append(examples["id"][sample])
        offset_mapping.append([o if sequence_ids[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])])
    enc.pop("overflow_to_sample_mapping")
    return {**enc, "example_id": example_ids, "offset_mapping": offset_mapping}


def postprocess_predictions(examples, features, start_logits: np.ndarray, end_logits: np.ndarray,
                            n_best: int = 20, max_answer_length: int = 30) -> dict[str, str]:
    """{example id: predicted answer text} from the windows' logits."""
    windows = collections.defaultdict(list)
    for index, example_id in enumerate(features["example_id"]):
        windows[example_id].append(index)
    predictions = {}
    for example in examples:
        best_score, best_text = -np.inf, ""
        for index in windows[example["id"]]:
            offsets = features["offset_mapping"][index]
            start_candidates = np.argsort(start_logits[index])[-1:-n_best - 1:-1]
            end_candidates = np.argsort(end_logits[index])[-1:-n_best - 1:-1]
            for s in start_candidates:
                for e in end_candidates:
                    if (s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None
                            or e < s or e - s + 1 > max_answer_length):
                        continue
                    score = start_logits[index][s] + end_logits[index][e]
                    if score > best_score:
                        best_score = score
                        best_text = example["context"][offsets[s][0]:offsets[e][1]]
        predictions[example["id"]] = best_text
    return predictions


def normalize_answer(text: str) -> str:
    """The official v1.1 normalisation: lower case, drop ASCII punctuation, drop articles, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1_score(prediction: str, gold: str) -> float:
    """Token-overlap F1 of evaluate-v1.1.py: 0 when nothing is shared, including when both normalise to nothing
    (SQuAD 2.0's scorer, and torchmetrics', give 1 there: its no-answer rule, which v1.1 does not have)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    shared = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_scores(examples, predictions: dict[str, str]) -> dict[str, float]:
    """Exact match and F1 (0-100) as the official SQuAD v1.1 scorer (evaluate-v1.1.py) computes them: each
    example's best score over its gold answers, averaged over examples (summed exactly, in float64)."""
    exact, f1 = [], []
    for example in examples:
        prediction, golds = predictions[example["id"]], list(example["answers"]["text"])
        exact.append(max(exact_match_score(prediction, gold) for gold in golds))
        f1.append(max(f1_score(prediction, gold) for gold in golds))
    return {"exact_match": 100.0 * math.fsum(exact) / len(exact), "f1": 100.0 * math.fsum(f1) / len(f1)}
