"""The `pii` text transform: e-mail addresses, public IP addresses and phone numbers -> placeholders.

Conventions: Dolma's placeholders (`|||EMAIL_ADDRESS|||`, `|||IP_ADDRESS|||`, `|||PHONE_NUMBER|||`,
the special tokens of OLMo's tokenizer), datatrove's rule for IPs (PIIFormatter: only public ones;
private, loopback and the like are not personal) and datatrove's e-mail pattern (RFC 5322 local
part), tightened where real text showed false positives (docs/preprocessing.md, "PII"). Dolma's
placeholders contain no '@', digit or ':', so a second pass finds nothing: running the transform
twice gives the same text. Addresses reserved for documentation are kept: e-mail at example.com/
.net/.org and the .example/.test/.invalid/.localhost names (RFC 2606, 6761), and the IP
documentation ranges (192.0.2.0/24, 2001:db8::/32, ...); so datatrove's own placeholders
(email@example.com) are never replaced again either.

Each kind runs only when a cheap test says it can match ('@' for e-mail, '::' or 7 ':' for IPv6,
a digit for IPv4 and phones), and text with nothing to replace comes back as the same object.

Phone numbers, two formats only, chosen for precision (years, verse and line numbers, dates,
prices, ISBNs and decimals do not match):
* North American (NANP): (212) 555-0123, 212-555-0123, 212.555.0123, 1-800-555-0199, 1 212 555
  0123; area code and exchange start with 2-9; '.' only with '.' (212 555.0123 is a decimal);
* international, written with '+': +44 20 7946 0958, +49 (0)30 123456, +33 1 23 45 67 89,
  +1 212 555 0123, +12125550123; 9 to 15 digits in all (E.164 has at most 15).
Not caught: national formats of other countries without '+' (UK 020 7946 0958, 0044 ...), a bare
NANP 10-digit run (2125550123: as likely an order number), 212 555 0123 with spaces only (as likely
a table row: 571 612 1056), vanity numbers (1-800-FLOWERS), a number right after another number.
"""
from __future__ import annotations

import ipaddress
import re
from collections import Counter
from typing import Callable, List

from common.config import ConfigError

from .config import PIIConfig, PreprocessConfig

KINDS = ("email", "ipv4", "ipv6", "phone")

# datatrove's local part without '/' (so a URL path before a name@host is not swallowed: ...archive.com/
# xz-devel@tukaani.org), starting with a letter, digit or '_' (so *name@x.org keeps its '*'), at most 64
# characters (RFC 5321) and never backtracking (possessive): linear however long a run without '@'. The
# top-level domain is letters (or punycode), so version pins like pkg@1.2.3 are not addresses.
_LOCAL = r"[A-Za-z0-9!#$%&'*+=?^_`{|}~-]"
_EMAIL = re.compile(
    rf"[A-Za-z0-9_](?<![A-Za-z0-9_.+-][A-Za-z0-9_])(?:{_LOCAL}|\.(?={_LOCAL})){{0,63}}+"
    r"@((?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+(?:[A-Za-z]{2,63}|xn--[A-Za-z0-9-]{1,59}))"
    r"(?![A-Za-z0-9-]|\.[A-Za-z0-9])")
# name@instance.ext is a file or a unit (gettext's sr@latin.po, en@quot.header, systemd's getty@tty1.service):
# these endings are no top-level domain.
_FILE_ENDINGS = frozenset("po pot gmo header txt json js ts html htm rst cc cpp hpp java png jpg jpeg gif svg css "
                          "xml yaml yml toml gz tgz bz2 xz tar whl deb rpm log conf cfg ini lock pdf exe dll lib "
                          "service socket timer mount device slice scope swap automount".split())
_RESERVED_TLDS = frozenset({"example", "test", "invalid", "localhost"})
_RESERVED_DOMAINS = frozenset({"example.com", "example.net", "example.org"})

# Every pattern starts with a character class and checks what precedes with a lookbehind placed after
# that first character: re then skips to candidates in C (3-5x faster on prose than a leading lookbehind).
# Not inside a longer dotted run (1.2.3.4.5, v1.2.3.4, 10.0.19041.1) nor a package version (2.10.0.9-1):
# section and version numbers. The octets (<= 255, no leading zero) are ipaddress's to check.
_IPV4 = re.compile(r"\d(?<![\w.]\d)\d{0,2}(?:\.\d{1,3}){3}(?![\w]|\.\d|[-+~]\d)")
# Four-part versions and section numbers are written after a comparison (lz4>=1.7.4.2, ==, ~=, !=, ^, ~),
# the word version or section (section 18.11.5.1, Policy 12.8.5.14), or open a heading line (3.43.1.1 Why
# ...): kept. A lone '=' is an assignment (src=93.184.216.34), a lone '<' a bracket (<93.184.216.34>).
_NUMBER_BEFORE = re.compile(r"(?:[<>~!=]=|[~^]|§|(?i:\b(?:versions?:?|released?|updated? to|sections?|chapter|"
                            r"policy))) ?$")
_HEADING_AFTER = re.compile(r"\.? [A-Z][a-z]")
# Candidates only in global unicast 2000::/3 (first group 2xxx or 3xxx), the only IPv6 space that is
# public; ipaddress checks the rest. Times (12:30:45), C++ (a::b) and hashes never start that way.
_IPV6 = re.compile(r"[23](?<![\w:.][23])[0-9A-Fa-f]{3}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def _first(chars: str, rest: str) -> str:
    """A phone number starting with `chars`, not glued to a longer number before it (a word, a price, a
    version 1:10~+2019..., the previous number of a space-separated table row)."""
    return rf"{chars}(?<![\w+$€£.,/~-]{chars})(?<!\d {chars}){rest}"


_EXCHANGE_LINE = r"[2-9]\d\d[-. ]\d{4}"
_PHONE = re.compile("(?:" + "|".join([
    # international: '+', country code, then groups; possessive throughout, so a long digit run fails
    # at once instead of trying every way to split it (the digit count is checked afterwards)
    _first(r"\+", r"[1-9]\d*+(?:[-. ]?\(\d{1,4}\)|[-. ]?\d++){0,7}+"),
    # NANP: 1-800-555-0199, (212) 555-0123, 212-555-0123
    _first("1", rf"[-. ]?(?:\([2-9]\d\d\)[-. ]?|[2-9]\d\d[-. ]){_EXCHANGE_LINE}"),
    _first(r"\(", rf"[2-9]\d\d\)[-. ]?{_EXCHANGE_LINE}"),
    _first("[2-9]", rf"\d\d[-. ]{_EXCHANGE_LINE}"),
]) + r")(?![\w+]|[-.,/]\d| \d)")
_DIGIT = re.compile(r"\d")
_NON_DIGIT = re.compile(r"\D")


def _email_kept(match: re.Match) -> bool:
    domain = match.group(1).lower()
    tld = domain.rpartition(".")[2]
    return tld in _RESERVED_TLDS or tld in _FILE_ENDINGS or ".".join(domain.split(".")[-2:]) in _RESERVED_DOMAINS


def _public_ip(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """datatrove's `is_global`, less multicast (Python 3.11 calls 224.0.0.0/4 global; nobody owns it)."""
    return address.is_global and not address.is_multicast


def _ipv4_kept(public_only: bool) -> Callable[[re.Match], bool]:
    def kept(match: re.Match) -> bool:
        try:
            address = ipaddress.IPv4Address(match.group(0))
        except ValueError:                      # an octet over 255 or with a leading zero
            return True
        text, start = match.string, match.start()
        if _NUMBER_BEFORE.search(text, max(0, start - 12), start):
            return True
        if (start == 0 or text[start - 1] == "\n") and _HEADING_AFTER.match(text, match.end()):
            return True
        first, second = address.packed[:2]
        if first < 10 and second < 20:
            return True                         # version-shaped: git 1.7.10.2, dpkg 1.15.8.10, section 2.2.1.1
        return public_only and not _public_ip(address)
    return kept


def _ipv6_kept(public_only: bool) -> Callable[[re.Match], bool]:
    def kept(match: re.Match) -> bool:
        try:
            address = ipaddress.IPv6Address(match.group(0))
        except ValueError:                      # 2024:10:15 and the like: colons, but no address
            return True
        if sum(1 for group in match.group(0).split(":") if group) < 3:
            return True                         # 2000:: (an rst heading "Oct 15 2000::"): real ones have more
        return public_only and not (address in _GLOBAL_UNICAST and _public_ip(address))
    return kept


def _phone_kept(match: re.Match) -> bool:
    number = match.group(0)
    if number.startswith("+"):
        return not 9 <= len(_NON_DIGIT.sub("", number)) <= 15
    separators = set(re.sub(r"[\d()+]", "", number))
    if separators == {" "} and "(" not in number and not number.startswith("1"):
        return True                             # 571 612 1056: numbers in a row, not a phone without (...) or 1
    return "." in separators and separators != {"."}


class _Replacer:
    """One kind: a pattern, a cheap test whether the text can hold one, and which matches stay."""

    def __init__(self, kind: str, pattern: re.Pattern, placeholder: str, can_match: Callable[[str], bool],
                 kept: Callable[[re.Match], bool]):
        self.kind, self.pattern, self.placeholder, self.can_match, self.kept = (kind, pattern, placeholder,
                                                                                can_match, kept)

    def __call__(self, text: str, counts: Counter) -> str:
        if not self.can_match(text):
            return text
        replaced = 0

        def one(match: re.Match) -> str:
            nonlocal replaced
            if self.kept(match):
                return match.group(0)
            replaced += 1
            return self.placeholder

        out = self.pattern.sub(one, text)
        if not replaced:
            return text                         # the same object: byte-identical, and cheap to compare
        counts[self.kind] += replaced
        return out


class PIITransform:
    """The kinds of `pii.kinds`, in the order email, ipv6, ipv4, phone (an IPv6 address is not left for the
    IPv4 and phone patterns to cut up); `counts`: replacements by kind."""

    def __init__(self, cfg: PIIConfig):
        problems = pii_problems(cfg)
        if problems:
            raise ConfigError(problems, source="pii")
        self.counts: Counter = Counter()
        makers = {
            "email": lambda: _Replacer("email", _EMAIL, cfg.email_placeholder, lambda t: "@" in t, _email_kept),
            "ipv6": lambda: _Replacer("ipv6", _IPV6, cfg.ip_placeholder,
                                      lambda t: "::" in t or t.count(":") >= 7, _ipv6_kept(cfg.public_ips_only)),
            "ipv4": lambda: _Replacer("ipv4", _IPV4, cfg.ip_placeholder, lambda t: "." in t and _DIGIT.search(t),
                                      _ipv4_kept(cfg.public_ips_only)),
            "phone": lambda: _Replacer("phone", _PHONE, cfg.phone_placeholder,
                                       lambda t: _DIGIT.search(t) is not None, _phone_kept),
        }
        self.replacers: List[_Replacer] = [makers[k]() for k in ("email", "ipv6", "ipv4", "phone") if k in cfg.kinds]

    def __call__(self, text: str) -> str:
        for replacer in self.replacers:
            text = replacer(text, self.counts)
        return text


def pii_problems(cfg: PIIConfig) -> List[str]:
    out = [f"pii.kinds: {kind!r} is not a PII kind. Fix: pick from {list(KINDS)} (an empty list replaces nothing)."
           for kind in cfg.kinds if kind not in KINDS]
    for kind, field in (("email", "email_placeholder"), ("ipv4", "ip_placeholder"), ("ipv6", "ip_placeholder"),
                        ("phone", "phone_placeholder")):
        if kind in cfg.kinds and not getattr(cfg, field):
            out.append(f"pii.{field} is empty, so a {kind} would vanish without a trace. Fix: a placeholder such "
                       f"as {getattr(PIIConfig(), field)!r}, or leave {kind!r} out of pii.kinds.")
    return list(dict.fromkeys(out))


def pii_transform(cfg: PreprocessConfig) -> PIITransform:
    """The `pii` transform (registered in preprocessing/transforms.py) with the `pii` section's settings."""
    return PIITransform(cfg.pii)
