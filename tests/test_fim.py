"""Fill-in-the-middle (pretrain/data/fim.py) on the demo corpus with the real BPE trained with the sentinels
(preprocessing/conf/demo-fim.yaml) and megatron-core's GPTDataset: documents come out as PSM or SPM at
the configured rates and keep their text, packed samples keep their length, EODs and determinism,
and a FIM-trained model exports to Hugging Face with the sentinels as special tokens."""
import math
import subprocess

import numpy as np
import pytest
import torch

from common.config import ConfigError
from common.files import exclusive
from pretrain.config.compose import load_recipe
from pretrain.config.data import FimConfig
from pretrain.data.fim import FimDataset, FimTransform, fim_tokens
from tests.conftest import REPO
from tests.training import shared_runs

DATA = REPO / "data/demo/bpe4k-fim"
SENTINELS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
DOCS = 2000
SIGMAS = 5


def preprocess_fim_data():
    """`make preprocess PREPROCESS=demo-fim` (after the demo_data fixture; ~7 s once, then markers skip it). One
    builder at a time: the shared runs' thread (fim_run) and this module's tests may both ask at once, and two
    concurrent builds of one prefix overwrite each other's parts."""
    with exclusive(REPO / "data" / ".demo-fim-build.lock"):
        res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=demo-fim"], cwd=REPO, capture_output=True,
                             text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def fim_data(demo_data):
    preprocess_fim_data()
    return DATA


@pytest.fixture(scope="module")
def tok(fim_data):
    from preprocessing.tokenizer_io import load_tokenizer
    return load_tokenizer("hf", fim_data / "tokenizer")


def parse(out: np.ndarray, ids, tok) -> tuple:
    """('psm'|'spm', prefix + middle + suffix text) of one FIM'd segment, asserting its layout."""
    out = out.tolist()
    for s in (ids.prefix, ids.middle, ids.suffix):
        assert out.count(s) == 1, (s, out)
    assert ids.pad not in out and out[0] == ids.prefix
    suf, mid = out.index(ids.suffix), out.index(ids.middle)
    if suf == 1:     # SPM: <PRE><SUF> suffix <MID> prefix middle (PSM with an empty prefix looks the same)
        return "spm", tok.decode(out[mid + 1:]) + tok.decode(out[2:mid])
    assert suf < mid, out
    return "psm", tok.decode(out[1:suf]) + tok.decode(out[mid + 1:]) + tok.decode(out[suf + 1:mid])


def within(count: int, n: int, p: float) -> bool:
    """`count` of `n` Bernoulli(p) draws within SIGMAS binomial standard deviations of n * p."""
    return abs(count - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p))


def test_the_trained_tokenizer_has_the_sentinels_as_special_tokens(tok, fim_data):
    from transformers import AutoTokenizer
    assert tok.vocab_size == 4096 and tok.eod == 0
    assert [tok.encode(s) for s in SENTINELS] == [[1], [2], [3], [4]]
    assert tok.decode(tok.encode("To be<fim_suffix>, or not")) == "To be, or not"     # special: skipped
    hf = AutoTokenizer.from_pretrained(str(fim_data / "tokenizer"))
    assert set(SENTINELS) <= set(hf.all_special_tokens)
    from preprocessing.tokenizer_io import load_tokenizer  # the demo's BPE: trained without them
    plain = load_tokenizer("hf", REPO / "data/demo/bpe4k/tokenizer")
    assert plain.tok.token_to_id("<fim_prefix>") is None and plain.vocab_size == 4096


def test_documents_become_psm_or_spm_at_the_rates_and_keep_their_text(tok, fim_data):
    """2,000 documents of the train split at rate 0.5, spm_rate 0.3: each one unchanged or one FIM form whose
    parts give back the document's text; the counts within 5 binomial sigmas; the cuts uniform over characters."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = IndexedDataset(str(fim_data / "train_text_document"))
    fim = FimConfig(rate=0.5, spm_rate=0.3)
    ids = fim_tokens(tok, fim, "demo-fim")
    transform = FimTransform(tok, ids, fim)
    forms, prefix_share = {"psm": 0, "spm": 0}, []
    for k in range(DOCS):
        doc = docs[k][:-1].astype(np.int64)                   # without its EOD
        out = transform.permute(doc, fim.rate, np.random.RandomState([3, k]))
        if out is doc:
            continue
        form, text = parse(out, ids, tok)
        original = tok.decode(doc.tolist())
        assert text == original, k
        forms[form] += 1
        if form == "psm":
            prefix_share.append(len(tok.decode(out[1:out.tolist().index(ids.suffix)].tolist())) / len(original))
    fimmed = forms["psm"] + forms["spm"]
    assert within(fimmed, DOCS, 0.5), forms                 # 1000 +- 112
    assert within(forms["spm"], fimmed, 0.3), forms         # ~300 +- 72
    # the smaller of two uniform cuts: mean 1/3, sd sqrt(1/18)
    assert abs(np.mean(prefix_share) - 1 / 3) <= SIGMAS * math.sqrt(1 / 18 / len(prefix_share)), np.mean(prefix_share)


def test_a_packed_sample_is_cut_at_eods_kept_in_length_and_padded_when_shorter(tok, fim_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = IndexedDataset(str(fim_data / "train_text_document"))
    fim = FimConfig(rate=1.0, spm_rate=0.0)
    ids = fim_tokens(tok, fim, "demo-fim")
    transform = FimTransform(tok, ids, fim)
    a, b, c = (docs[k][:n].astype(np.int64) for k, n in ((0, 40), (1, 50), (2, 30)))
    eod = [ids.eod]
    sample = np.concatenate([a, eod, eod, b, eod, c])        # an empty document between two EODs
    out = transform(sample, np.random.RandomState(5))
    assert len(out) == len(sample)
    replay = np.random.RandomState(5)                        # the same draws, segment by segment
    whole = np.concatenate([transform.permute(a, 1.0, replay), eod, eod, transform.permute(b, 1.0, replay), eod,
                            transform.permute(c, 1.0, replay)])
    assert len(whole) > len(sample) and (out == whole[:len(sample)]).all()   # 9 sentinels more: the tail is cut
    segments = np.split(whole, np.flatnonzero(whole == ids.eod))
    assert [int(s[0]) for s in segments[1:]] == [ids.eod] * 3 and len(segments[1]) == 1    # the EODs stay
    for seg, original in zip((segments[0], segments[2][1:], segments[3][1:]), (a, b, c), strict=True):
        assert parse(seg, ids, tok) == ("psm", tok.decode(original.tolist()))
    # a segment that re-encodes shorter (one token per character): padded with <fim_pad> to the same length
    chars = np.array([t for ch in tok.decode(a.tolist()) for t in tok.encode(ch)], dtype=np.int64)
    out = transform(chars, np.random.RandomState(6))
    real = int((out != ids.pad).sum())
    assert len(out) == len(chars) and real < len(chars) / 2 and (out[real:] == ids.pad).all()
    assert parse(out[:real], ids, tok)[1] == tok.decode(a.tolist())
    assert (transform(sample, np.random.RandomState(5)) == transform(sample, np.random.RandomState(5))).all()
    off = FimTransform(tok, ids, FimConfig(rate=0.0))
    assert (off(sample, np.random.RandomState(5)) == sample).all()       # rate 0: the identity


def test_the_training_datasets_hold_fim_samples_deterministic_by_index(fim_data, tok):
    """build_datasets of gpt-tiny-fim: every split is a FimDataset over the GPTDataset, of the same length; samples
    of seq_length tokens, labels the next tokens, no loss on <fim_pad> labels; each document in a sample FIM'd at
    rate 0.5 and keeping its text; the same sample for an index whatever the order of reads and across builds."""
    from pretrain.data.datasets import build_datasets
    cfg = load_recipe("gpt-tiny-fim")
    datasets = build_datasets(cfg, 400, 64, 64)
    plain = build_datasets(load_recipe("gpt-tiny-fim", ["data.fim.rate=0"]), 400, 64, 64)
    assert all(isinstance(d, FimDataset) for d in datasets) and not isinstance(plain[0], FimDataset)
    assert [len(d) for d in datasets] == [len(d) for d in plain]
    train, raw, ids = datasets[0], plain[0], datasets[0].transform.ids
    n, seq, fimmed, expected, variance, checked = 300, cfg.model.seq_length, 0, 0.0, 0.0, 0
    for i in range(n):
        s = train[i]
        assert all(len(v) == seq for v in s.values())
        assert (s["tokens"][1:] == s["labels"][:-1]).all() and (s["position_ids"] == torch.arange(seq)).all()
        assert (s["loss_mask"] == (s["labels"] != ids.pad).float()).all()
        mine, theirs = train.sample(i), raw._query_document_sample_shuffle_indices(i)[0]
        assert (s["tokens"] == torch.from_numpy(mine[:-1])).all() and len(mine) == len(theirs) == seq + 1
        mine_segs = [x[x != ids.eod] for x in np.split(mine, np.flatnonzero(mine == ids.eod))]
        their_segs = [x[x != ids.eod] for x in np.split(theirs, np.flatnonzero(theirs == ids.eod))]
        k = sum(len(t) > 0 for t in their_segs)
        p = 1 - 0.5 ** k                          # P(at least one of the k documents FIM'd)
        expected, variance, fimmed = expected + p, variance + p * (1 - p), fimmed + bool((mine == ids.prefix).any())
        for m, t in zip(mine_segs[:-1], their_segs, strict=False):     # before the last EOD: not cut
            if (m == ids.prefix).any():
                assert parse(m, ids, tok)[1] == tok.decode(t.tolist()), i
                checked += 1
            else:
                assert (m == t).all(), i
    assert abs(fimmed - expected) <= SIGMAS * math.sqrt(variance), (fimmed, expected)
    assert checked > 0                            # FIM'd documents that a sample holds whole were checked
    again = build_datasets(cfg, 400, 64, 64)[0]
    for i in reversed(range(50)):
        assert (again[i]["tokens"] == train[i]["tokens"]).all()
    assert not (datasets[1].sample(0) == train.sample(0)).all()       # valid and train draw differently
    off = FimDataset(raw, FimTransform(tok, ids, FimConfig(rate=0.0)), cfg.seed)
    for i in range(20):                          # rate 0: exactly the GPTDataset's samples
        a, b = off[i], raw[i]
        assert a.keys() == b.keys() and all((a[key] == b[key]).all() for key in a)


def test_a_tokenizer_without_the_sentinels_fails_at_dataset_build_naming_it_and_the_fix(demo_data):
    from pretrain.data.datasets import build_datasets
    cfg = load_recipe("gpt-tiny", ["data.fim.rate=0.5"])
    with pytest.raises(ValueError, match=r"data/demo/bpe4k/tokenizer .*no token \['<fim_prefix>'.*fim_sentinels: true"):
        build_datasets(cfg, 64, 8, 8)


@pytest.mark.parametrize("override, message", [
    ("data.fim.rate=1.5", "data.fim.rate=1.5 is not a probability"),
    ("data.fim.spm_rate=-0.1", "data.fim.spm_rate=-0.1 is not a probability"),
    ("data.mock=true", "data.fim.rate > 0 with data.mock"),
    ("data.fim.split_sample='<fim_pad>'", "data.fim.split_sample='<fim_pad>' is a FIM sentinel"),
])
def test_fim_rules_fire_at_compose_time(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_recipe("gpt-tiny-fim", [override])


def test_the_fim_recipes_compose():
    tiny, big = load_recipe("gpt-tiny-fim"), load_recipe("code-1b-fim")
    assert (tiny.data.fim.rate, tiny.data.fim.spm_rate, tiny.data.blend) == (0.5, 0.5, "data/demo/bpe4k-fim/blend.json")
    assert (big.data.fim.rate, big.model.seq_length, big.cluster.devices_per_node) == (0.5, 4096, 8)
    assert big.derived.tokens_per_step == 512 * 4096 and big.derived.padded_vocab_size >= 4096


# ---- a FIM-trained tiny model through the real entry point, exported to Hugging Face ---------------------------
@shared_runs(nproc=1)
def fim_run(root, runs):
    """gpt-tiny on demo-fim with FIM at rate 0.5 for 4 steps, saving its final checkpoint."""
    preprocess_fim_data()
    return {"fim": ["data=demo-fim", "data.fim.rate=0.5", "schedule.train_iters=4", "checkpoint.save_final=true"]}


@pytest.mark.slow
def test_a_fim_trained_model_exports_with_the_sentinels(fim_run, single_rank_megatron, tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of, export
    records = fim_run("fim")
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)
    ckpt = fim_run.root / "fim" / "checkpoints"
    assert config_of(resolve(ckpt)).data.fim.rate == 0.5                 # it trained on FIM samples
    exported = export(ckpt, tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(str(exported))
    for s in SENTINELS:
        assert hf_tok.encode(s, add_special_tokens=False) == tok.encode(s) and s in hf_tok.all_special_tokens
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert model.config.vocab_size == 4096 > max(tok.encode("".join(SENTINELS)))
    prompt = hf_tok("<fim_prefix>To be, or not<fim_suffix> is the question<fim_middle>",
                    add_special_tokens=False)["input_ids"]
    assert prompt[0] == 1 and 3 in prompt and prompt[-1] == 2
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), 4096) and torch.isfinite(logits).all()
