"""The encoder objectives' samples (pretrain/objectives/samples.py) on the demo corpus one sentence per sequence
(make preprocess PREPROCESS=demo-sentences): BERT's masked LM at 15 % with 80/10/10, NSP and SOP at 50/50, the
denoising samples' layout and their document noises undone exactly, the same sample from every instance and
the epochs counted; bad input refused naming the file and the fix."""
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pretrain.config.objective import ObjectiveConfig
from pretrain.objectives.corpus import SentenceCorpus
from pretrain.objectives.noise import undo_document_noise
from pretrain.objectives.samples import build_samples
from tests.conftest import REPO

DATA = REPO / "data/demo/wordpiece-sentences"
SIGMAS = 5
SEQ = 128
BERT_KEYS = {"tokens": ((SEQ,), torch.int64), "types": ((SEQ,), torch.int64), "labels": ((SEQ,), torch.int64),
             "loss_mask": ((SEQ,), torch.float32), "padding_mask": ((SEQ,), torch.int64),
             "is_random": ((), torch.int64)}




@pytest.fixture(scope="module")
def sentence_data(demo_data):
    """data/demo/wordpiece-sentences: the demo_data fixture builds it (`make preprocess PREPROCESS=demo-sentences`,
    tests/conftest.py); test_objective_noise.py shares it."""
    return DATA


def config(data, name: str, blend=None, tokenizer=None, cache_dir=None, **fields):
    o = ObjectiveConfig(name=name)
    for k, v in fields.items():
        setattr(o.masked_lm if name == "masked_lm" else o.denoising, k, v)
    return SimpleNamespace(objective=o, seed=1234, model=SimpleNamespace(seq_length=SEQ, vocab_size=4096),
                           data=SimpleNamespace(blend=str(blend or data / "blend.json"), cache_dir=cache_dir,
                                                tokenizer=SimpleNamespace(type="hf", path=str(tokenizer or
                                                                                              data / "tokenizer"))))


def within(count: float, n: int, p: float) -> bool:
    return abs(count - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("head", ["nsp", "sop"])
def test_masked_lm_statistics(sentence_data, head):
    """15 % of the real tokens other than [CLS]/[SEP] predicted (BERT's round(0.15 * len(tokens)), which counts
    them), 80/10/10 [MASK]/random/kept, pairs 50/50, keys and shapes; a random token is never a special one."""
    train = build_samples(config(sentence_data, "masked_lm", binary_head=head), [600, 0, 0])[0]
    n = 600
    batch = [train[i] for i in range(n)]
    assert all({k: (tuple(v.shape), v.dtype) for k, v in s.items()} == BERT_KEYS for s in batch)
    tok, lab, loss, pad = (torch.stack([s[k] for s in batch]) for k in ("tokens", "labels", "loss_mask",
                                                                         "padding_mask"))
    real = int(pad.sum()) - 3 * n                               # [CLS] A [SEP] B [SEP]
    chosen = loss > 0
    assert all(int(c.sum()) == max(1, round(0.15 * int(p.sum()))) for c, p in zip(chosen, pad, strict=True))
    assert within(int(chosen.sum()), real, 0.15), int(chosen.sum()) / real
    assert (lab[~chosen] == 0).all() and (tok[pad == 0] == 0).all()
    sp = train.sp
    assert not torch.isin(lab[chosen], torch.tensor([sp.cls, sp.sep, sp.pad])).any()
    masked = int((tok[chosen] == sp.mask).sum())
    kept = int((tok[chosen] == lab[chosen]).sum())
    randomised = int(chosen.sum()) - masked - kept
    m = int(chosen.sum())
    assert within(masked, m, 0.8) and within(randomised, m, 0.1) and within(kept, m, 0.1), (masked, randomised, kept)
    swapped = tok[chosen][(tok[chosen] != sp.mask) & (tok[chosen] != lab[chosen])]
    assert not np.isin(swapped.numpy(), [sp.ids[t] for t in sp.ids]).any() and (swapped >= 107).all()
    is_random = int(sum(int(s["is_random"]) for s in batch))
    assert within(is_random, n, 0.5), is_random
    again = build_samples(config(sentence_data, "masked_lm", binary_head=head), [600, 0, 0])[0]
    assert all(torch.equal(again[i][k], batch[i][k]) for i in (599, 7, 0) for k in BERT_KEYS)
    print(f"{head}: predicted {int(chosen.sum()) / real:.4f} of {real} tokens; mask/random/keep {masked / m:.3f}/"
          f"{randomised / m:.3f}/{kept / m:.3f}; is_random {is_random / n:.3f}; {train.summary}")


@pytest.mark.parametrize("head", ["nsp", "sop"])
def test_pairs_are_what_the_head_says(sentence_data, head):
    """Before truncation: A then B is the sample's text when not random; SOP's random is B then A; NSP's random B
    comes from another document."""
    train = build_samples(config(sentence_data, "masked_lm", binary_head=head), [300, 0, 0])[0]
    c = train.corpus
    for i in range(300):
        first, stop, _ = (int(x) for x in train.index[train.order(i)])
        text = np.concatenate(c.sentences(first, stop))
        a, b, is_random, _ = train.segments(i, train.rng(i))
        if not is_random:
            assert np.array_equal(np.concatenate([a, b]), text)
        elif head == "sop":
            assert np.array_equal(np.concatenate([b, a]), text)
        else:
            assert np.array_equal(a, text[:len(a)]) and not np.array_equal(b, text[len(a):len(a) + len(b)])


def test_denoising_samples(sentence_data):
    """T5 and BART samples with both document noises: keys, lengths, masks; the decoder input is <s> then the
    target shifted; BART's target is the text before any noise, and the document noises undo exactly from the
    sample's seed; sample i is the same from another instance (a resumed run) and whatever was read before."""
    counts = []
    for style in ("t5", "bart"):
        cfg = config(sentence_data, "denoising", style=style, sentence_permutation=True, document_rotation=True)
        train = build_samples(cfg, [300, 0, 0])[0]
        again = build_samples(cfg, [300, 0, 0])[0]
        d = train.dec_length
        assert (train.raw, d) == ((141, 29) if style == "t5" else (SEQ - 1, SEQ))
        for i in range(0, 300, 3):
            s = train[i]
            shapes = {k: (tuple(v.shape), v.dtype) for k, v in s.items()}
            assert shapes == {"text_enc": ((SEQ,), torch.int64), "text_dec": ((d,), torch.int64),
                              "labels": ((d,), torch.int64), "loss_mask": ((d,), torch.float32),
                              "enc_mask": ((SEQ,), torch.int64), "dec_mask": ((d,), torch.int64)}
            n = int(s["dec_mask"].sum())
            assert s["text_dec"][0] == train.sp.bos and torch.equal(s["text_dec"][1:n], s["labels"][:n - 1])
            assert torch.equal(s["loss_mask"].bool(), s["dec_mask"].bool()) and s["labels"][n - 1] == train.sp.eos
            assert s["text_enc"][int(s["enc_mask"].sum()) - 1] == train.sp.eos
            sentences = train.sentences(i)
            original = np.concatenate(sentences)
            noised = train.noised_document(i, train.rng(i))
            back = undo_document_noise(noised, [len(x) for x in sentences], True, True, train.rng(i))
            assert np.array_equal(back, original)
            if style == "bart":
                assert np.array_equal(s["labels"][:n - 1].numpy(), original)
            other = again[299 - i]                              # a different read order first
            assert all(torch.equal(v, again[i][k]) for k, v in s.items()) and other is not None
            if style == "t5":                                   # span count and noise of this sample's length
                spans = int((s["labels"] >= train.sp.sentinels[0]).logical_and(
                    s["labels"] <= train.sp.sentinels[-1]).sum())
                noise = n - spans - 1
                length = int(s["enc_mask"].sum()) - 1 + noise - spans
                counts.append((length, noise, spans))
        print(style, train.summary)
    # over samples of every length (a document's last one is shorter): noise density and mean span length miss
    # 0.15 and 3 by T5's rounding only, at most 1/2 token of noise and 1/2 span per sample
    length, noise, spans = np.array(counts).sum(axis=0)
    assert abs(noise / length - 0.15) <= 0.5 * len(counts) / length
    assert abs(noise / spans - 3.0) <= 1.5 * len(counts) / spans
    print(f"t5: {len(counts)} samples of {length / len(counts):.1f} tokens: noise {noise / length:.4f}, "
          f"mean span {noise / spans:.3f}")


def test_epochs_wrap_and_splits_differ(sentence_data):
    """A valid split asked for 2.5 epochs: 3 epochs counted, each epoch every sample once in its own order."""
    valid = build_samples(config(sentence_data, "denoising"), [0, 1, 0])[1]
    n = valid.summary["samples_per_epoch"]
    wrapped = build_samples(config(sentence_data, "denoising"), [0, int(2.5 * n), 0])[1]
    assert len(wrapped) == int(2.5 * n) and wrapped.summary["epochs"] == 3
    e0 = [wrapped.order(i) for i in range(n)]
    e1 = [wrapped.order(i) for i in range(n, 2 * n)]
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1
    train, valid, test = build_samples(config(sentence_data, "masked_lm"), [10, 10, 10])
    assert not torch.equal(train[0]["tokens"], valid[0]["tokens"])


def test_bad_input(sentence_data, tmp_path):
    """A tokenizer without the special tokens, a document-level dataset, documents of one sentence for NSP, a
    decoder too short for the T5 targets."""
    short = config(sentence_data, "denoising")
    short.derived = SimpleNamespace(decoder_seq_length=20)
    with pytest.raises(ValueError, match=r"model.decoder_seq_length=20: the t5 targets of seq_length=128 take up to "
                                         r"29 tokens"):
        build_samples(short, [1, 0, 0])
    bpe = REPO / "data/demo/bpe4k/tokenizer"
    with pytest.raises(ValueError, match=r"bpe4k/tokenizer \(data.tokenizer.path\) has no token \['\[PAD\]'.*"
                                         r"PREPROCESS=demo-sentences"):
        build_samples(config(sentence_data, "masked_lm", tokenizer=bpe), [1, 0, 0])
    with pytest.raises(ValueError, match=r"train_text_document.idx holds one sequence per document.*document-level"
                                         r".*split_sentences: true"):
        SentenceCorpus(str(REPO / "data/demo/bpe4k/train_text_document")).require_sentences("objective.masked_lm")
    # the demo's sentences, one document each, written as preprocessing writes a sentence-level split
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    corpus = SentenceCorpus(str(sentence_data / "valid_text_sentence"))
    prefix = tmp_path / "train_text_sentence"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for k in range(50):
        builder.add_item(torch.from_numpy(corpus.sentence(k)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    (tmp_path / "train_text_sentence.json").write_text(json.dumps({"sentences": 50, "append_eod": False}))
    (tmp_path / "blend.json").write_text(json.dumps({"format": "pretrain-blend/1", "splits": {
        "train": [{"weight": 1.0, "prefix": "train_text_sentence"}]}}))
    for head in ("nsp", "sop"):
        with pytest.raises(ValueError, match=r"train_text_sentence.idx: all 50 documents have fewer than 2 sentences"
                                             r" \(50 have one.*binary_head=null"):
            build_samples(config(sentence_data, "masked_lm", blend=tmp_path / "blend.json", binary_head=head),
                          [1, 0, 0])
    single = build_samples(config(sentence_data, "masked_lm", blend=tmp_path / "blend.json", binary_head=None),
                           [1, 0, 0])
    assert single[1] is None and single[0].summary["samples_per_epoch"] == 50


def test_blend_of_two_prefixes(sentence_data, tmp_path):
    """A split of two prefixes weighted 3:1: megatron-core's blending order takes 300 and 100 of 400 samples, each
    component built with exactly what it gives."""
    (tmp_path / "blend.json").write_text(json.dumps({"format": "pretrain-blend/1", "splits": {"train": [
        {"weight": 3.0, "prefix": str(sentence_data / "valid_text_sentence")},
        {"weight": 1.0, "prefix": str(sentence_data / "test_text_sentence")}]}}))
    train = build_samples(config(sentence_data, "masked_lm", blend=tmp_path / "blend.json", binary_head="sop"),
                          [400, 0, 0])[0]
    assert len(train) == 400 and np.bincount(train.which).tolist() == [300, 100]
    assert [len(d) for d in train.datasets] == [300, 100]
    i = int(np.flatnonzero(train.which == 1)[5])
    assert torch.equal(train[i]["tokens"], train.datasets[1][int(train.at[i])]["tokens"])


def test_sample_indexes_are_cached(sentence_data, tmp_path):
    """The BERT sample index and the denoising pieces are built once into data.cache_dir and loaded byte-equal from
    there by the next build; another key (short_seq_prob, seed, split, data) builds anew."""
    cache = tmp_path / "cache"
    first = build_samples(config(sentence_data, "masked_lm", cache_dir=cache, binary_head="sop"), [50, 50, 0])
    assert [d.summary["index_cache"] for d in first] == ["built"] * 3       # train, valid, test: one key each
    assert len(list(cache.glob("bert_sample_index-*.npy"))) == 3
    again = build_samples(config(sentence_data, "masked_lm", cache_dir=cache, binary_head="sop"), [7, 9, 3])
    assert [d.summary["index_cache"] for d in again] == ["loaded"] * 3          # the sample count is no key
    for a, b in zip(first, again, strict=True):
        assert a.index.dtype == b.index.dtype and a.index.tobytes() == b.index.tobytes() and len(a.index) > 100
    other = build_samples(config(sentence_data, "masked_lm", cache_dir=cache, binary_head="sop", short_seq_prob=0.5),
                          [50, 0, 0])[0]
    assert other.summary["index_cache"] == "built" and other.index.tobytes() != first[0].index.tobytes()
    cfg = config(sentence_data, "masked_lm", cache_dir=cache, binary_head="sop")
    cfg.seed = 99
    assert build_samples(cfg, [50, 0, 0])[0].summary["index_cache"] == "built"
    # the same prefix preprocessed again (new .idx mtime): a new data_version, so a new index
    (tmp_path / "blend.json").write_text(json.dumps({"format": "pretrain-blend/1", "splits": {
        "train": [{"weight": 1.0, "prefix": str(tmp_path / "s")}]}}))
    for ext in ("bin", "idx", "json"):
        (tmp_path / f"s.{ext}").write_bytes((sentence_data / f"valid_text_sentence.{ext}").read_bytes())
    moved = config(sentence_data, "masked_lm", blend=tmp_path / "blend.json", cache_dir=cache, binary_head="sop")
    assert build_samples(moved, [50, 0, 0])[0].summary["index_cache"] == "built"
    assert build_samples(moved, [50, 0, 0])[0].summary["index_cache"] == "loaded"
    os.utime(tmp_path / "s.idx", ns=(1, 1))
    assert build_samples(moved, [50, 0, 0])[0].summary["index_cache"] == "built"
    for style in ("t5", "bart"):
        dn = config(sentence_data, "denoising", cache_dir=cache, style=style)
        built, loaded = build_samples(dn, [10, 0, 0])[0], build_samples(dn, [10, 0, 0])[0]
        assert (built.summary["index_cache"], loaded.summary["index_cache"]) == ("built", "loaded")
        assert all(np.array_equal(getattr(built, k), getattr(loaded, k)) for k in ("first", "stop", "offset"))
    assert not list(cache.glob("*.tmp")) and all(np.load(p, allow_pickle=False).size for p in cache.glob("*.npy"))


@pytest.mark.parametrize("recipe", ["bert-tiny", "t5-tiny"])
def test_micro_batches_stack_the_objectives_keys(sentence_data, recipe, tmp_path):
    """An objective's build_datasets marks its datasets with its batch_keys and StepBatches stacks exactly those (no
    guess from what a sample holds); a sample that lacks a declared key is refused naming it."""
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import StepBatches, collate
    from pretrain.objectives.registry import objective_for
    cfg = load_recipe(recipe, [f"data.cache_dir={tmp_path}"])
    objective = objective_for(cfg)
    keys = objective.batch_keys
    train = objective.build_datasets([8, 0, 0], lambda: True)[0]
    (batch,) = StepBatches(train, 4, 0, 2).micro_batches(0, 8)
    assert tuple(batch) == keys and all(v.shape[0] == 4 for v in batch.values())
    assert torch.equal(batch[keys[0]][1], train[1][keys[0]])
    samples = [{k: v for k, v in train[i].items() if k != keys[-1]} for i in range(2)]
    with pytest.raises(KeyError, match=rf"lacks the batch key\(s\) \['{keys[-1]}'\]"):
        collate(samples, keys)
