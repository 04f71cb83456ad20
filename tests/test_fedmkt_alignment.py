"""FedMKT across tokenizers (docs/fedmosaic.md#fedmkt-across-tokenizers): the vocabulary map, the two sequence
alignments on hand-made tokenizations, the mass a teacher's distribution carries to the student's tokens (where
sharing ids would put it on other words), and a round between two architectures whose tokenizers number the same
words differently."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rayfed.data.multimodal import vocabulary
from rayfed.errors import ConfigError
from rayfed.methods.fedmkt import FedMKT, FedMKTParams, full_logits
from rayfed.methods.token_alignment import Vocabulary, VocabularyMap, aligned_cut, dtw_pairs, greedy_dp_spans
from rayfed.zoo.causal_lm import RECIPES, tiny_config
from rayfed.zoo.tokenizers import BOS, EOS, MASK, PAD, SPECIAL_TOKENS, UNK

from test_fedmosaic_competitors import _one_round

# Two SentencePiece- and byte-level-style vocabularies of the same words (spec M4): "utilize" is one teacher token
# and two student tokens; "colour" is the teacher's spelling of the student's "color"; ids differ throughout.
TEACHER = Vocabulary(("<pad>", "</s>", "Ġthe", "Ġutilize", "Ġcat", "Ġcolour", "Ġred"), (-1, 1, 0, -1))
STUDENT = Vocabulary(("<eos>", "▁red", "▁the", "▁util", "ize", "▁cats", "▁bat", "▁color", "<pad>"), (-1, 0, 8, -1))


def test_the_vocabulary_map_takes_roles_then_the_identical_token_then_the_nearest_with_the_lowest_id():
    mapping = VocabularyMap(TEACHER, STUDENT)
    assert [mapping(i) for i in range(len(TEACHER.tokens))] == [8, 0, 2, 3, 5, 7, 1]
    # pad and end of text by role; Ġthe = ▁the (one marker); utilize -> util (3 edits); cat -> cats or bat (1 edit
    # each): the lower id; colour -> color (1 edit)


def test_greedy_dp_matches_a_word_to_its_pieces_even_at_the_first_token():
    assert greedy_dp_spans(["the", "util", "ize"], ["the", "utilize"]) == [((0, 0), (0, 0)), ((1, 2), (1, 1))]
    assert greedy_dp_spans(["util", "ize"], ["utilize"]) == [((0, 1), (0, 0))]  # K-f: FedMosaic's code misses it
    assert greedy_dp_spans(["a", "bc", "d"], ["ab", "cd"]) == [((0, 2), (0, 1))]
    assert greedy_dp_spans(["x", "the"], ["the", "y"]) == [((1, 1), (0, 0))]  # non-crossing, most student tokens
    assert greedy_dp_spans(["red"], ["blue"]) == []


def _cut(rows: list[dict[int, float]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor([list(row.values()) for row in rows])
    return values[:, :width], torch.tensor([list(row) for row in rows])[:, :width]


def test_greedy_dp_gives_a_span_its_fused_distribution_at_its_first_token_and_a_one_hot_elsewhere():
    mapping = VocabularyMap(TEACHER, STUDENT)
    values, ids = _cut([{2: 3.0, 4: 1.0}, {3: 2.0, 6: 0.5}], 2)  # at Ġthe: the, cat; at Ġutilize: utilize, red
    out_values, out_ids = aligned_cut([2, 3, 4], [2, 3], values, ids, mapping, "greedy_dp", 3)
    assert out_ids[0].tolist() == [2, 5, 2] and out_values[0].tolist() == [3.0, 1.0, 3.0]  # padded with the first
    assert out_ids[1].tolist() == [3, 1, 3] and out_values[1].tolist() == [2.0, 0.5, 2.0]
    assert set(out_ids[2].tolist()) == {4}  # "ize": the span's second token, all its mass on itself
    # The other way round: the teacher's "util" and "ize" make the student's "utilize", whose target is their
    # logits averaged per token (red: (1 + 3) / 2), mapped (color -> colour, red -> red, cats -> cat).
    values, ids = _cut([{2: 1.0, 1: 0.0}, {7: 2.0, 1: 1.0}, {1: 3.0, 5: 0.0}], 2)
    out_values, out_ids = aligned_cut([2, 3], [2, 3, 4], values, ids, VocabularyMap(STUDENT, TEACHER), "greedy_dp", 3)
    assert out_ids.tolist() == [[2, 6, 2], [5, 6, 4]] and out_values[1].tolist() == [2.0, 2.0, 0.0]


def test_dtw_carries_a_distribution_only_where_the_warped_tokens_agree_directly_or_through_the_map():
    assert dtw_pairs(["the", "color"], ["the", "colour"]) == [[0], [1]]
    mapping = VocabularyMap(TEACHER, STUDENT)
    values, ids = _cut([{2: 1.0, 4: 0.0}, {5: 2.0, 6: 1.0}, {3: 1.0, 2: 0.0}], 2)
    out_values, out_ids = aligned_cut([2, 7, 4], [2, 5, 4], values, ids, mapping, "dtw", 2)
    assert out_ids.tolist() == [[2, 5], [7, 1], [4, 4]]  # the; color (= colour through M); ize against cat: one-hot
    assert out_values[1].tolist() == [2.0, 1.0]


def _permuted_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The offline word tokenizer's words, numbered from the other end (special tokens where they were)."""
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *reversed(vocabulary())])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, unk_token=UNK,
                                                bos_token=BOS, eos_token=EOS, mask_token=MASK)


def test_the_aligned_target_puts_the_teachers_mass_on_the_same_words_where_shared_ids_would_not():
    from rayfed.zoo.tokenizers import word_tokenizer

    words, permuted = Vocabulary.of(word_tokenizer(append_eos=False)), Vocabulary.of(_permuted_tokenizer())
    mapping = VocabularyMap(permuted, words)
    text = ["red", "circle", EOS]
    teacher = [permuted.tokens.index(t) for t in text]
    student = [words.tokens.index(t) for t in text]
    blue, green = permuted.tokens.index("blue"), permuted.tokens.index("green")
    values = torch.tensor([[2.0, 1.0, 0.0]] * 3)
    ids = torch.tensor([[teacher[0], blue, green], [teacher[1], blue, green], [teacher[2], blue, green]])
    out_values, out_ids = aligned_cut(student, teacher, values, ids, mapping, "greedy_dp", 3)
    taught = torch.softmax(full_logits({"t": out_values, "t:ids": out_ids}, "t", len(words.tokens)), -1)
    teacher_probs = torch.softmax(values, -1)
    for position in range(3):
        for rank, word in enumerate((text[position], "blue", "green")):
            assert taught[position, words.tokens.index(word)] == pytest.approx(float(teacher_probs[position, rank]))
    shared = torch.softmax(full_logits({"t": values, "t:ids": ids}, "t", len(words.tokens)), -1)
    assert shared[0, words.tokens.index("blue")] == 0  # shared ids: blue's teacher id is another student word
    assert float(taught.sum(-1).sub(1).abs().max()) < 1e-6  # M3


def test_fedmkt_keeps_no_vocabularies_for_one_tokenizer_and_needs_a_cut_across_two():
    one, other = STUDENT.to_tensors(), TEACHER.to_tensors()
    assert Vocabulary.from_tensors(other) == TEACHER
    server = {"global": {}, "clients": {}}
    assert FedMKT().before_federation(server, {"a": one, "b": dict(one)}) is server
    with pytest.raises(ConfigError, match=r"top_k = null, but architectures 'a' and 'b' tokenize differently"):
        FedMKT().before_federation(server, {"a": one, "b": other})
    kept = FedMKT(FedMKTParams(top_k=4)).before_federation(server, {"a": one, "b": other})
    assert set(kept["vocabularies"]) == {f"{arch}/{name}" for arch in "ab" for name in one}
    with pytest.raises(ValueError, match="^alignment = 'edit' is invalid: must be one of 'greedy_dp', 'dtw'.$"):
        FedMKTParams(alignment="edit")


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory):
    """Round 1 of FedMKT (top-5 cuts) between the offline word tokenizer's Llama (clients 0, 1) and a random Llama
    over the same words numbered the other way round (clients 2, 3)."""
    folder = tmp_path_factory.mktemp("permuted")
    tokenizer = _permuted_tokenizer()
    transformers.LlamaForCausalLM(tiny_config("llama", RECIPES["llama-small"]["model"], tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = {"source": "synthetic-text", "kind": "text_generation", "max_text_length": 12,
            "options": {"num_samples": 16, "prompt_words": 5, "target_words": 3}}
    run = {"name": "tokenizers", "seed": 2,
           "data": {**text, "num_clients": 4, "partition": {"name": "iid"},
                    "public": {**text, "options": {**text["options"], "num_samples": 6}}},
           "model": {"backbone": "tiny-pretrained:llama-small", "lora": {"rank": 2, "alpha": 4}},
           "architectures": {"words": {"clients": [0, 1], "backbone": "tiny-pretrained:llama-small"},
                             "permuted": {"clients": [2, 3], "backbone": f"hf:{folder}"}},
           "federation": {"rounds": 1, "clients_per_round": 4},
           "train": {"local_steps": 1, "batch_size": 4, "lr": 0.01, "optimizer": "adamw"},
           "methods": [{"name": "fedmkt", "public_samples": 6, "top_k": 5}],
           "placement": {"executor": "local", "clients_per_actor": 2}}
    return _one_round({}, run=run)


def test_a_round_across_tokenizers_distils_each_teachers_words_into_the_students_ids(two_tokenizers):
    first, driver, uploads, aggregated, requests, results = two_tokenizers
    vocabularies = {arch: Vocabulary.from_tensors({n: aggregated["vocabularies"][f"{arch}/{n}"]
                                                   for n in ("bytes", "offsets", "special")})
                    for arch in ("words", "permuted")}
    outputs = results[0]
    architecture = {0: "words", 1: "words", 2: "permuted", 3: "permuted"}
    best = torch.stack([outputs[architecture[c]][f"loss:{c}"] for c in range(4)]).min(dim=0).indices
    crossed = 0
    for student, other in (("words", "permuted"), ("permuted", "words")):
        request, row_of, source = requests[1][student], outputs[student]["row_of"], outputs[other]
        for row in range(6):  # where a client of the other architecture is best, it teaches across tokenizers
            teacher, at, source_at = int(best[row]), row_of == row, source["row_of"] == row
            if architecture[teacher] != other or not request["trains"][row]:
                continue
            crossed += 1
            taught = [vocabularies[student].tokens[i] for i in request["target:ids"][at].flatten().tolist()]
            teaching = [vocabularies[other].tokens[i]
                        for i in source[f"logits:{teacher}:ids"][source_at].flatten().tolist()]
            assert taught == teaching  # the same words, one for one: their ids in the student's vocabulary
            assert torch.equal(request["target"][at], source[f"logits:{teacher}"][source_at])
            assert not torch.equal(request["target:ids"][at], source[f"logits:{teacher}:ids"][source_at])
    assert crossed  # not vacuous: some rows are taught across the tokenizers
    payloads = driver.payloads([0, 1, 2, 3])
    assert all(torch.isfinite(v).all() for p in payloads.values() for v in p.values())
    assert any(not torch.equal(payloads[c][n], uploads[c]["shared"][n]) for c in range(4) for n in payloads[c])
