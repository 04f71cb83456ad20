"""Token alignment between two tokenizers (FedMKT's cross-family distillation, after FuseLLM): a teacher's
token-level distributions, computed on its own tokenization of a text, carried to a student that tokenizes the same
text with another vocabulary.

Two parts, both on token strings (a word-boundary marker, ``Ġ`` of byte-level BPE or ``▁`` of SentencePiece, is
one marker; special tokens compare by their role: begin, end of text, padding, unknown):

- the **vocabulary map** M from teacher ids to student ids: a teacher token's special role maps to the student's
  token of that role; otherwise an identical student token wins, else the student token at the minimum edit
  distance (ties: the lowest student id); computed for the ids that occur and kept;
- the **sequence alignment** of a text's two tokenizations: ``greedy_dp`` (FedMosaic's, a FATE-LLM option): the
  non-crossing pairs of spans whose concatenated strings (markers removed) are equal, chosen by a dynamic programme
  to cover the most student tokens; a span's teacher distributions are averaged per token id and given to its
  first student position. ``dtw`` (FATE-LLM's default): dynamic time warping at an edit-distance cost; a student
  position takes the distribution of the one teacher position it is warped to when their tokens are equal directly
  or through M. Every other student position gets all its mass on its own token (the label: these are the
  positions of the reference answer, teacher-forced).

A distribution travels as a top-k cut: the k largest logits of a position and their token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from rayfed.tasks.kinds import end_of_text_id
from rayfed.types import TensorDict

MARKERS = ("Ġ", "▁")  # byte-level BPE's and SentencePiece's word-boundary marker
ROLES = ("bos", "eos", "pad", "unk")
Alignment = Literal["greedy_dp", "dtw"]  # aligned_cut's strategies


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's token strings by id and the ids of its special roles (``ROLES``; -1: none)."""

    tokens: tuple[str, ...]
    special: tuple[int, ...]

    def role(self, token_id: int) -> str | None:
        return ROLES[self.special.index(token_id)] if token_id in self.special else None

    def text(self, token_id: int) -> str:
        """The token as a sequence alignment compares it: its role for a special token, else its string without
        word-boundary markers."""
        role = self.role(token_id)
        if role is not None:
            return f"<{role}>"
        text = self.tokens[token_id]
        for marker in MARKERS:
            text = text.replace(marker, "")
        return text

    def to_tensors(self) -> TensorDict:
        """The vocabulary as tensors (to travel and be checkpointed): the tokens' UTF-8 bytes end to end, where each
        starts, and the special ids."""
        encoded = [token.encode("utf-8") for token in self.tokens]
        offsets = np.cumsum([0, *(len(piece) for piece in encoded)])
        return {"bytes": torch.tensor(list(b"".join(encoded)), dtype=torch.uint8),
                "offsets": torch.as_tensor(offsets, dtype=torch.int64), "special": torch.tensor(self.special)}

    @classmethod
    def from_tensors(cls, tensors: TensorDict) -> Vocabulary:
        data, offsets = tensors["bytes"].numpy().tobytes(), tensors["offsets"].tolist()
        tokens = tuple(data[a:b].decode("utf-8") for a, b in zip(offsets, offsets[1:]))
        return cls(tokens, tuple(int(i) for i in tensors["special"].tolist()))

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        """A Hugging Face tokenizer's vocabulary, with the end of a target text as its ``eos``."""
        tokens = tuple(str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        ids = (tokenizer.bos_token_id, end_of_text_id(tokenizer), tokenizer.pad_token_id, tokenizer.unk_token_id)
        return cls(tokens, tuple(-1 if i is None else int(i) for i in ids))


def edit_distances(query: str, candidates: np.ndarray) -> np.ndarray:
    """Levenshtein distance from ``query`` to each row of ``candidates`` (code points, one length), at once."""
    count, length = candidates.shape
    previous = np.tile(np.arange(length + 1), (count, 1))
    for i, char in enumerate(query, start=1):
        current = np.empty_like(previous)
        current[:, 0] = i
        substitution = previous[:, :-1] + (candidates != ord(char))
        for j in range(1, length + 1):
            current[:, j] = np.minimum(np.minimum(previous[:, j] + 1, current[:, j - 1] + 1), substitution[:, j - 1])
        previous = current
    return previous[:, -1]


@dataclass
class VocabularyMap:
    """M: teacher ids -> student ids (see the module), computed per id on first use and kept."""

    teacher: Vocabulary
    student: Vocabulary
    known: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._exact: dict[str, int] = {}
        by_length: dict[int, list[int]] = {}
        for token_id, token in enumerate(self.student.tokens):
            if self.student.role(token_id) is None:
                self._exact.setdefault(_canonical(token), token_id)
                by_length.setdefault(len(_canonical(token)), []).append(token_id)
        self._buckets = {
            length: (np.asarray(ids), np.asarray([[ord(c) for c in _canonical(self.student.tokens[i])] for i in ids],
                                                 dtype=np.int64).reshape(len(ids), length))
            for length, ids in by_length.items()}

    def __call__(self, token_id: int) -> int:
        if token_id not in self.known:
            self.known[token_id] = self._mapped(token_id)
        return self.known[token_id]

    def _mapped(self, token_id: int) -> int:
        role = self.teacher.role(token_id)
        if role is not None and self.student.special[ROLES.index(role)] >= 0:
            return self.student.special[ROLES.index(role)]
        query = _canonical(self.teacher.tokens[token_id])
        if query in self._exact:
            return self._exact[query]
        best, best_id = None, -1
        for length in sorted(self._buckets, key=lambda n: (abs(n - len(query)), n)):
            if best is not None and abs(length - len(query)) > best:
                break  # no string of this length or farther can come closer
            ids, strings = self._buckets[length]
            distances = edit_distances(query, strings)
            nearest = int(distances.min())
            candidate = int(ids[distances == nearest].min())
            if best is None or (nearest, candidate) < (best, best_id):
                best, best_id = nearest, candidate
        return best_id


def _canonical(token: str) -> str:
    return token.replace(MARKERS[1], MARKERS[0])


def greedy_dp_spans(student: Sequence[str], teacher: Sequence[str]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The non-crossing pairs of spans (student first..last, teacher first..last) whose concatenated strings are
    equal, covering the most student tokens; in order. A span ends at each pair of positions and grows backwards on
    the side whose string is shorter until both are as long (a match) or one side runs out; a span may start at the
    first token of either side."""
    spans: dict[tuple[int, int], tuple[int, int]] = {}  # (student end, teacher end) -> the span's lengths
    for i in range(len(student)):
        for j in range(len(teacher)):
            a, b, left, right = student[i], teacher[j], i - 1, j - 1
            while len(a) != len(b):
                if len(a) < len(b) and left >= 0:
                    a, left = student[left] + a, left - 1
                elif len(b) < len(a) and right >= 0:
                    b, right = teacher[right] + b, right - 1
                else:
                    break
            if a == b and a:
                spans[(i, j)] = (i - left, j - right)
    # covered[i][j]: the most student tokens covered within the first i student and j teacher tokens.
    covered = np.zeros((len(student) + 1, len(teacher) + 1), dtype=np.int64)
    for i in range(1, len(student) + 1):
        for j in range(1, len(teacher) + 1):
            covered[i, j] = max(covered[i - 1, j], covered[i, j - 1])
            if (i - 1, j - 1) in spans:
                s, t = spans[(i - 1, j - 1)]
                covered[i, j] = max(covered[i, j], covered[i - s, j - t] + s)
    chosen, i, j = [], len(student), len(teacher)
    while i > 0 and j > 0:
        span = spans.get((i - 1, j - 1))
        if span is not None and covered[i, j] == covered[i - span[0], j - span[1]] + span[0]:
            chosen.append(((i - span[0], i - 1), (j - span[1], j - 1)))
            i, j = i - span[0], j - span[1]
        elif covered[i, j] == covered[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return chosen[::-1]


def dtw_pairs(student: Sequence[str], teacher: Sequence[str]) -> list[list[int]]:
    """For each student position, the teacher positions dynamic time warping at an edit-distance cost pairs it
    with (the path from the first pair to the last; on a tie a diagonal step, then a student step)."""
    cost = np.array([[edit_distances(s, np.array([[ord(c) for c in t]], dtype=np.int64).reshape(1, len(t)))[0]
                      for t in teacher] for s in student], dtype=np.float64)
    total = np.full((len(student) + 1, len(teacher) + 1), np.inf)
    total[0, 0] = 0
    for i in range(1, len(student) + 1):
        for j in range(1, len(teacher) + 1):
            total[i, j] = cost[i - 1, j - 1] + min(total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
    pairs: list[list[int]] = [[] for _ in student]
    i, j = len(student), len(teacher)
    while i > 0 and j > 0:
        pairs[i - 1].append(j - 1)
        steps = (total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
        move = int(np.argmin(steps))
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    return [sorted(p) for p in pairs]


def aligned_cut(student_ids: Sequence[int], teacher_ids: Sequence[int], values: torch.Tensor, ids: torch.Tensor,
                mapping: VocabularyMap, strategy: Alignment, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A text's teacher top-k cut (``values``, ``ids``: one row per teacher token of ``teacher_ids``) as a cut of
    ``width`` entries at the student's tokens ``student_ids`` in the student's vocabulary (module docstring). A row
    of fewer entries repeats its first (the same token and logit: the distribution is unchanged)."""
    student_text = [mapping.student.text(i) for i in student_ids]
    teacher_text = [mapping.teacher.text(i) for i in teacher_ids]
    rows: list[dict[int, float]] = [{token: 0.0} for token in student_ids]  # all mass on the position's own token
    if strategy == "greedy_dp":
        for (first, _), (t_first, t_last) in greedy_dp_spans(student_text, teacher_text):
            rows[first] = _mapped(_fused(values[t_first:t_last + 1], ids[t_first:t_last + 1]), mapping, width)
    else:
        for position, pairs in enumerate(dtw_pairs(student_text, teacher_text)):
            if len(pairs) == 1 and (student_text[position] == teacher_text[pairs[0]]
                                    or mapping(teacher_ids[pairs[0]]) == student_ids[position]):
                rows[position] = _mapped(dict(zip(ids[pairs[0]].tolist(), values[pairs[0]].tolist())), mapping, width)
    out_values = torch.empty(len(rows), width, dtype=values.dtype)
    out_ids = torch.empty(len(rows), width, dtype=ids.dtype)
    for position, row in enumerate(rows):
        kept = list(row.items())[:width]
        kept += [kept[0]] * (width - len(kept))
        out_ids[position] = torch.tensor([token for token, _ in kept])
        out_values[position] = torch.tensor([value for _, value in kept])
    return out_values, out_ids


def _fused(values: torch.Tensor, ids: torch.Tensor) -> dict[int, float]:
    """Per token id, the mean of its logits over the span's positions whose cut holds it."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for token, value in zip(ids.flatten().tolist(), values.flatten().tolist()):
        sums[token] = sums.get(token, 0.0) + value
        counts[token] = counts.get(token, 0) + 1
    return {token: total / counts[token] for token, total in sums.items()}


def _mapped(logits: dict[int, float], mapping: VocabularyMap, width: int) -> dict[int, float]:
    """Teacher logits by teacher id -> by student id through M, the largest first; where two teacher ids map to
    one student id the larger logit wins; the ``width`` largest."""
    out: dict[int, float] = {}
    for token, value in sorted(logits.items(), key=lambda item: -item[1]):
        out.setdefault(mapping(token), value)
        if len(out) == width:
            break
    return out
