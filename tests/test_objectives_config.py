"""Compose-time rules of the objectives (pretrain/config/objective.py): bad recipes are refused with the
field and the fix before anything runs; the T5 lengths follow T5's own arithmetic."""
import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.config.objective import DenoisingConfig, denoising_lengths, span_counts


def refused(recipe, overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, overrides)
    return str(err.value)


def test_the_encoder_recipes_compose_with_their_objectives():
    bert, t5 = load_recipe("bert-tiny"), load_recipe("t5-tiny")
    assert (bert.objective.name, bert.objective.masked_lm.binary_head) == ("masked_lm", "nsp")
    assert (t5.objective.name, t5.objective.denoising.style) == ("denoising", "t5")
    assert (t5.derived.num_decoder_layers, t5.derived.decoder_seq_length) == (3, 29)
    assert load_recipe("gpt-tiny").objective.causal


def test_t5_lengths_are_t5s_own():
    # T5's random_spans_helper for inputs_length=512, noise 0.15, mean span 3: 568 raw tokens, 114 targets
    assert denoising_lengths(512, DenoisingConfig()) == (568, 114)
    noise, spans = span_counts(568, 0.15, 3.0)
    assert 568 - noise + spans + 1 == 512
    # BART: encoder and decoder share one length; the decoder writes the whole raw text and </s>
    assert denoising_lengths(512, DenoisingConfig(style="bart")) == (511, 512)


@pytest.mark.parametrize("recipe,overrides,words", [
    ("bert-tiny", ["objective.name=denoising"], ["objective.name=denoising with model.arch=bert",
                                                  "objective.name=masked_lm"]),
    ("gpt-tiny", ["+objective=masked-lm"], ["model.arch=gpt", "objective.name=causal_lm"]),
    ("bert-tiny", ["parallel=ds-zero3"], ["deepspeed.zero_stage=3 with objective.name=masked_lm",
                                          "deepspeed.zero_stage<=2"]),
    ("bert-tiny", ["parallel.pipeline_model_parallel_size=2", "cluster.devices_per_node=2"],
     ["parallel.pipeline_model_parallel_size > 1 with objective.name=masked_lm"]),
    ("bert-tiny", ["objective.masked_lm.binary_head=next"], ["binary_head='next'", "nsp, sop or null"]),
    ("t5-tiny", ["objective.denoising.mean_span_length=0.5"], ["mean_span_length=0.5"]),
    ("bert-tiny", ["objective.masked_lm.mask_token_fraction=0.95"], ["random_token_fraction must be in [0, 1]"]),
    ("gpt-tiny", ["model.num_decoder_layers=2"], ["model.num_decoder_layers / decoder_seq_length are T5's"]),
])
def test_bad_objective_recipes_are_refused_with_the_fix(recipe, overrides, words):
    text = refused(recipe, overrides)
    for word in words:
        assert word in text, text


def sentence_blend(tmp_path, documents, sentences_per_document):
    """A sentence-level blend.json as preprocessing writes one (split_sentences): one train prefix and its counts."""
    import json

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefix = tmp_path / "train_text_sentence"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in range(documents):
        for s in range(sentences_per_document):
            builder.add_item(__import__("torch").tensor([7 + d, 8 + s, 9]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    single = documents if sentences_per_document == 1 else 0
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"format": "pretrain-blend/1", "splits": {"train": [{"weight": 1.0, "prefix":
                                 "train_text_sentence"}]}, "tokenizer": {}, "sentences": {"train": {
                                 "sentences": documents * sentences_per_document, "single_sentence_documents": single,
                                 "empty_documents": 0, "long_sentence_documents": 0}}}))
    return blend


def test_a_sentence_pair_head_on_single_sentence_documents_is_refused(tmp_path):
    tiny = "data.max_epochs=1e9"                        # 15 tokens of data: only the pairs rule may speak
    blend = sentence_blend(tmp_path, 5, 1)
    text = refused("bert-tiny", [f"data.blend={blend}", tiny])
    assert "binary_head=nsp" in text and "none of its 5 train documents has two sentences" in text
    assert "binary_head=null" in text                                   # the fix
    load_recipe("bert-tiny", [f"data.blend={blend}", tiny, "objective.masked_lm.binary_head=null"])  # MLM alone
    load_recipe("bert-tiny", [f"data.blend={sentence_blend(tmp_path, 5, 2)}", tiny])               # pairs: fine


def test_a_document_level_blend_is_refused_for_the_encoder_objectives(tmp_path):
    import json
    blend = sentence_blend(tmp_path, 3, 2)
    body = json.loads(blend.read_text())
    del body["sentences"]
    blend.write_text(json.dumps(body))
    text = refused("t5-tiny", [f"data.blend={blend}", "data.max_epochs=1e9"])
    assert "is document-level" in text and "tokenize.split_sentences=true" in text
