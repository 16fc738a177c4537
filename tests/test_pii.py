"""The `pii` text transform (preprocessing/pii.py) and the transform registry (preprocessing/transforms.py):
PII planted into real text (the demo corpus) is all replaced with the exact placeholders, look-alikes that
are not PII stay, text without PII comes back byte-identical (the whole demo corpus), counts by kind."""
import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from common.config import ConfigError
from preprocessing.config import PIIConfig, PreprocessConfig
from preprocessing.fetch import fetch
from preprocessing.pii import PIITransform
from preprocessing.transforms import TRANSFORMS, TextTransforms, register_transform, transform_problems

EMAIL, IP, PHONE = "|||EMAIL_ADDRESS|||", "|||IP_ADDRESS|||", "|||PHONE_NUMBER|||"

# (planted text, kind, what it becomes): every format the module docstring claims
PLANTED = [
    ("john.smith@gmail.com", "email", EMAIL),
    ("jane.doe+newsletter@mail.cs.stanford.edu", "email", EMAIL),
    ("o'brien_99@sub.domain.co.uk", "email", EMAIL),
    ("INFO@Example-Shop.DE", "email", EMAIL),
    ("x@xn--bcher-kva.ch", "email", EMAIL),
    ("93.184.216.34", "ipv4", IP),
    ("8.26.56.26", "ipv4", IP),
    ("203.0.114.1", "ipv4", IP),
    ("255.254.253.1", "ipv4", "255.254.253.1"),            # 240.0.0.0/4 is reserved: not public
    ("2607:f8b0:4005:80a::200e", "ipv6", IP),
    ("2607:f8b0:4005:080a:0000:0000:0000:200e", "ipv6", IP),
    ("2a03:2880:f12f:83:face:b00c:0:25de", "ipv6", IP),
    ("2001:4860:4860::8888", "ipv6", IP),
    ("(212) 555-0123", "phone", PHONE),
    ("212-555-0123", "phone", PHONE),
    ("212.555.0123", "phone", PHONE),
    ("(415)555-0199", "phone", PHONE),
    ("1-800-555-0199", "phone", PHONE),
    ("+1 212 555 0123", "phone", PHONE),
    ("+1 (212) 555-0123", "phone", PHONE),
    ("+12125550123", "phone", PHONE),
    ("+44 20 7946 0958", "phone", PHONE),
    ("+49 (0)30 1234567", "phone", PHONE),
    ("+33 1 23 45 67 89", "phone", PHONE),
    ("+91-98765-43210", "phone", PHONE),
    ("+81 3-1234-5678", "phone", PHONE),
]

# Look-alikes that are not PII (or not public): the text stays byte-identical.
KEPT = [
    "bob@example.com", "alice@mail.example.org", "root@host.test", "email@example.com", "pkg@1.2.3", "@types/node",
    "user@localhost", "po/sr@latin.po", "en@quot.header", "getty@tty1.service", "8.8.8.8", "1.1.1.1", "10.0.0.1",
    "192.168.1.254", "172.16.0.5", "127.0.0.1", "169.254.10.20", "100.64.0.1",
    "0.0.0.0", "192.0.2.1", "198.51.100.7", "203.0.113.9", "224.0.0.251", "255.255.255.255", "256.1.2.3",
    "::1", "fe80::1ff:fe23:4567:890a", "fd12:3456:789a::1", "2001:db8::1", "ff02::1", "::ffff:10.0.0.1",
    "12:30:45", "std::vector", "a::b", "3:16", "1599", "1623", "2024-01-15", "15/01/2024", "$1,234.56",
    "€12.50", "978-0-306-40615-7", "0-306-40615-2", "ISBN 0306406152", "3.14159", "1,234,567,890",
    "v1.2.3.4", "lz4>=1.7.4.2", "version 4.3.3.0", "dpkg (1.15.8.10)", "git 1.7.10.2", "1.2.3.4.5",
    "binutils (2.10.0.9-1)", "212 555.0123", "571 612 1056", "02110-1301", "+2024-01-15", "+1 555 0123",
    "1:10~+20191229111838", "lines 1234-1240", "Act 3, scene 2, 101-120",
]


@pytest.fixture(scope="module")
def corpus():
    return [json.loads(line)["text"] for line in Path(fetch("shakespeare")).open(encoding="utf-8")]


def pii(**settings) -> PIITransform:
    return PIITransform(PIIConfig(**settings))


def plant(text: str, items, seed: int) -> tuple:
    """`items` inserted at random word boundaries of `text`: (text with them, text with their replacements)."""
    rng = random.Random(seed)
    words = text.split(" ")
    spots = sorted(rng.sample(range(1, len(words)), len(items)))
    planted, expected = list(words), list(words)
    for offset, (spot, (value, _, out)) in enumerate(zip(spots, items, strict=True)):
        planted.insert(spot + offset, value)
        expected.insert(spot + offset, out)
    return " ".join(planted), " ".join(expected)


def test_planted_pii_is_all_replaced_with_the_exact_placeholders(corpus):
    long_docs = [d for d in corpus if d.count(" ") > 200]
    transform = pii()
    for i, doc in enumerate(long_docs[:20]):
        items = random.Random(i).sample(PLANTED, 8)
        planted, expected = plant(doc, items, seed=i)
        assert transform(planted) == expected
    # and in every surrounding punctuation a text puts around them
    for value, _, out in PLANTED:
        for before, after in (("(", ")"), ("<", ">"), ('"', '",'), ("[", "]:443"), ("tel: ", "."), ("\n", "\n")):
            assert transform(f"Call{before}{value}{after} now") == f"Call{before}{out}{after} now", value


def test_look_alikes_are_kept_byte_identical(corpus):
    transform = pii()
    doc = next(d for d in corpus if d.count(" ") > 300)
    planted, expected = plant(doc, [(k, None, k) for k in KEPT], seed=7)
    assert planted == expected
    assert transform(planted) is planted
    for value in KEPT:
        assert transform(f"see {value}, then") == f"see {value}, then", value
    assert transform.counts == Counter()
    # what surrounds an address stays: a URL path before it, a '*' of markup
    assert transform("https://lists.example.net/archive/xz-devel@tukaani.org") == \
        f"https://lists.example.net/archive/{EMAIL}"
    assert transform("*stefank@valicert.com, tel:+1-212-555-0123") == f"*{EMAIL}, tel:{PHONE}"


def test_the_demo_corpus_has_no_pii_and_comes_back_as_the_same_strings(corpus):
    transform = pii()
    assert len(corpus) > 3000
    assert sum(transform(doc) is not doc for doc in corpus) == 0
    assert transform.counts == Counter()


def test_counts_per_kind_and_a_second_pass_finds_nothing():
    transform = pii()
    text = " and ".join(value for value, _, _ in PLANTED)
    once = transform(text)
    wanted = Counter(kind for value, kind, out in PLANTED if out != value)
    assert transform.counts == wanted == Counter(email=5, ipv4=3, ipv6=4, phone=13)
    assert transform(once) is once                      # Dolma's placeholders hold no '@', digit or ':'
    assert transform.counts == wanted


def test_settings_kinds_placeholders_private_ips():
    text = "Mail ann@uni-bonn.de from 93.184.216.34 or 10.1.2.3, call (212) 555-0123."
    datatrove = pii(email_placeholder="email@example.com", ip_placeholder="22.214.171.124",
                    phone_placeholder="<PHONE>")
    once = datatrove(text)
    assert once == "Mail email@example.com from 22.214.171.124 or 10.1.2.3, call <PHONE>."
    assert datatrove(once) == once and sum(datatrove.counts.values()) == 3 + 1  # its fake IP is public: again
    assert pii(kinds=["email"])(text) == text.replace("ann@uni-bonn.de", EMAIL)
    assert pii(public_ips_only=False)(text).count(IP) == 2
    assert pii(kinds=[])(text) is text


def test_bad_settings_and_unknown_transforms_are_refused_with_the_field_named():
    cfg = PreprocessConfig(output_dir="out", transforms=["pii", "pi"])
    [problem] = transform_problems(cfg)
    assert "transforms[1]='pi'" in problem and "'pii'" in problem and "register_transform('pi')" in problem
    with pytest.raises(ConfigError, match=r"transforms\[1\]='pi'"):
        TextTransforms(cfg)
    bad = dataclasses.replace(cfg, transforms=["pii"], pii=PIIConfig(kinds=["email", "ssn"], email_placeholder=""))
    problems = transform_problems(bad)
    assert len(problems) == 2 and "pii.kinds: 'ssn'" in problems[0] and "pii.email_placeholder" in problems[1]
    assert transform_problems(PreprocessConfig(output_dir="out")) == []


@register_transform("test_upper_shout")
def upper_shout(cfg):
    """A transform registered outside the project: '!' -> '!!', counted."""
    class Shout:
        counts: Counter = Counter()

        def __call__(self, text):
            n = text.count("!")
            self.counts["shout"] += n
            return text.replace("!", "!!") if n else text
    return Shout()


def test_text_transforms_applies_the_config_in_order_and_merges_counts(corpus):
    assert "pii" in TRANSFORMS and "test_upper_shout" in TRANSFORMS
    apply = TextTransforms(PreprocessConfig(output_dir="out", transforms=["pii", "test_upper_shout"]))
    assert apply.names == ["pii", "test_upper_shout"]
    assert apply("Write to ann@uni-bonn.de!") == f"Write to {EMAIL}!!"
    quiet = "No mail here."
    assert apply(quiet) is quiet
    assert apply.counts == Counter(email=1, shout=1) and apply.changed == 1
    assert TextTransforms(PreprocessConfig(output_dir="out", transforms=[]))(quiet) is quiet
