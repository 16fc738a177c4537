"""Stage 4: load or train a tokenizer; one interface for the three kinds people have.

* `gpt2`: a directory with GPT-2's vocab.json + merges.txt (or OpenAI's encoder.json +
  vocab.bpe), byte-level BPE with GPT-2's pre-tokenizer regex - the ids equal those of
  Megatron-LM's GPT2BPETokenizer. EOD is `<|endoftext|>`.
* `hf`: a Hugging Face tokenizer directory (tokenizer.json) or file.
* `sentencepiece`: a `.model` file; EOD is its eos id, no BOS is added (Megatron-LM's
  SentencePieceTokenizer; its Llama2Tokenizer prepends BOS).
Training writes a byte-level BPE as tokenizer.json + tokenizer_config.json (loadable by
transformers) and vocab.json + merges.txt (loadable by Megatron-LM's GPT2BPETokenizer), or (`train_wordpiece`,
for BERT and T5) an uncased BERT WordPiece as tokenizer.json + tokenizer_config.json (transformers'
BertTokenizerFast, AutoTokenizer) and vocab.txt (Megatron-LM's BertWordPieceLowerCase).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

from common.digest import file_digest
from common.files import replace_dir

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# Fill-in-the-middle sentinels (Megatron-LM / bigcode FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD): pretrain/data/fim.py
FIM_SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
# The WordPiece tokenizer's special tokens, ids 0.. in this order: BERT's five, BOS/EOS for T5's decoder
# (`</s>` is also the EOD), then T5's span-corruption sentinels <extra_id_0>..<extra_id_99>.
BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>")
T5_SENTINELS = tuple(f"<extra_id_{i}>" for i in range(100))


def detect_type(path: str | Path) -> str:
    p = Path(path)
    if p.is_file():
        return "sentencepiece" if p.suffix == ".model" or ".model." in p.name else "hf"
    if (p / "tokenizer.json").exists():
        return "hf"
    if ((p / "vocab.json").exists() and (p / "merges.txt").exists()) or (p / "encoder.json").exists():
        return "gpt2"
    if (p / "tokenizer.model").exists():
        return "sentencepiece"
    raise FileNotFoundError(f"{p}: not a tokenizer (need tokenizer.json, vocab.json+merges.txt, "
                            "encoder.json+vocab.bpe, or a SentencePiece .model)")


class HFTokenizer:
    """`tokenizers.Tokenizer` behind the interface (types 'hf' and 'gpt2')."""

    def __init__(self, tok, kind: str, files: List[Path], eod: Optional[int] = None):
        self.tok, self.kind, self.files = tok, kind, files
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if eod is None:
            eod = next((tok.token_to_id(t) for t in EOD_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eod is None:
            raise ValueError(f"{files[0]}: no end-of-document token among {EOD_CANDIDATES}")
        self.eod = eod

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        """Ids of each text: `encode_batch_fast` skips the offsets (`encode_batch` took 1.6x as long), runs on the
        tokenizers thread pool unless TOKENIZERS_PARALLELISM is false (see `one_thread`)."""
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids)

    def save(self, directory: str | Path, max_length: int | None = None) -> None:
        """tokenizer.json + transformers config (for exports and AutoTokenizer); `max_length`: the model's
        positions, so transformers truncates and warns there instead of indexing past the position table."""
        from tokenizers import models
        from transformers import BertTokenizerFast, PreTrainedTokenizerFast
        limit = {"model_max_length": max_length} if max_length else {}
        if isinstance(self.tok.model, models.WordPiece):         # BERT/T5: BertTokenizerFast names its specials
            BertTokenizerFast(tokenizer_object=self.tok, do_lower_case=self.tok.normalizer.lowercase,
                              bos_token="<s>", eos_token="</s>", additional_special_tokens=list(T5_SENTINELS),
                              **limit).save_pretrained(str(directory))
            return
        eod = self.tok.id_to_token(self.eod)
        # the other special tokens (FIM sentinels) listed too, so transformers treats them as special
        extra = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special and t.content != eod]
        PreTrainedTokenizerFast(tokenizer_object=self.tok, eos_token=eod, bos_token=eod, unk_token=eod,
                                additional_special_tokens=extra, **limit).save_pretrained(str(directory))


class SentencePieceTokenizer:
    def __init__(self, path: Path, threads: int = 2):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.kind, self.files, self.threads = "sentencepiece", [path], threads
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        return self.sp.encode(texts, num_threads=self.threads)

    def encode(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def decode(self, ids: List[int]) -> str:
        return self.sp.decode(ids)

    def save(self, directory: str | Path, max_length: int | None = None) -> None:
        from transformers import LlamaTokenizer
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        LlamaTokenizer(vocab_file=str(self.files[0]), add_bos_token=False, legacy=True,
                       **({"model_max_length": max_length} if max_length else {})).save_pretrained(str(directory))


@contextmanager
def one_thread(tok) -> Iterator[None]:
    """Encode on the calling thread only, in this process and in processes forked meanwhile (which
    then neither start a thread pool nor print tokenizers' fork warning); restored afterwards."""
    old_env, old_threads = os.environ.get("TOKENIZERS_PARALLELISM"), getattr(tok, "threads", None)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"      # read by tokenizers at every batch call
    if old_threads is not None:
        tok.threads = 1
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old_env
        if old_threads is not None:
            tok.threads = old_threads


def load_tokenizer(kind: Optional[str], path: str | Path, threads: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {p} does not exist (data.tokenizer.path / TOKENIZER)")
    kind = kind or detect_type(p)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(p / "tokenizer.model" if p.is_dir() else p, threads)
    if kind == "hf":
        f = p / "tokenizer.json" if p.is_dir() else p
        return HFTokenizer(Tokenizer.from_file(str(f)), "hf", [f])
    if kind == "gpt2":
        vocab, merges = p / "vocab.json", p / "merges.txt"
        if not vocab.exists():
            vocab, merges = p / "encoder.json", p / "vocab.bpe"
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return HFTokenizer(tok, "gpt2", [vocab, merges])
    raise ValueError(f"tokenizer type {kind!r}: use gpt2, hf or sentencepiece")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int, out_dir: str | Path,
              extra_special: Iterable[str] = ()) -> HFTokenizer:
    """Byte-level BPE of `vocab_size` ids in all: <|endoftext|> (id 0), then `extra_special` (ids 1...), then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<|endoftext|>", *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    result = HFTokenizer(tok, "hf", [out / "tokenizer.json"])
    result.save(tmp)
    tok.model.save(str(tmp))            # vocab.json + merges.txt (GPT-2 format)
    replace_dir(tmp, out, ours="tokenizer.json")
    return result


def train_wordpiece(texts: Iterable[str], vocab_size: int, min_frequency: int, out_dir: str | Path) -> HFTokenizer:
    """BERT's uncased WordPiece (bert-base-uncased's normaliser, pre-tokenizer and "##" continuation) of `vocab_size`
    ids in all: BERT_SPECIAL then T5_SENTINELS (ids 0..106), then the learnt pieces. Its post-processor adds
    [CLS] A [SEP] (B [SEP]) when transformers encodes with special tokens; the data pipeline encodes without."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=[*BERT_SPECIAL, *T5_SENTINELS], show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    result = HFTokenizer(tok, "hf", [out / "tokenizer.json"])
    result.save(tmp)
    tok.model.save(str(tmp))            # vocab.txt (BERT format)
    replace_dir(tmp, out, ours="tokenizer.json")
    return result


def describe(tok) -> dict:
    return {"type": tok.kind, "vocab_size": tok.vocab_size, "eod": tok.eod,
            "files": {str(f): file_digest(f) for f in tok.files if Path(f).exists()}}


def dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1))
