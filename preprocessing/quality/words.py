"""English word splitting as datatrove 0.10.1 does it, without spaCy.

datatrove's `split_into_words(text, "en")` is spaCy's blank English tokenizer (`spacy.blank("en")`, rule
based, no model download) with whitespace tokens dropped; `split_into_sentences` adds spaCy's `sentencizer`.
This module re-implements that algorithm: split on whitespace runs, then per chunk peel prefixes and
suffixes (stopping at a special case), keep URLs whole, split the rest at infixes, merge special cases that
hold an affix. The patterns and character lists are spaCy's `lang/punctuation.py`, `lang/char_classes.py`
and URL_MATCH (MIT), its letter classes in preprocessing/quality/spacy_chars.py. The special cases are
spaCy's English contractions and abbreviations, regenerated below by rule (tested equal).
tests/test_quality_parity.py measures the word lists and the filter decisions against the real thing.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

from .spacy_chars import ALPHA, ALPHA_LOWER, ALPHA_UPPER

_AL, _AU, _A = ALPHA_LOWER, ALPHA_UPPER, ALPHA
_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》\u3008\u3009\u2329\u232a⟦⟧"
_Q = re.escape(_QUOTES)
_PUNCT = ["…", "……", ",", ":", ";", r"\!", r"\?", "¿", "؟", "¡", r"\(", r"\)", r"\[", r"\]", r"\{", r"\}", "<",
          ">", "_", "#", r"\*", "&", "。", "？", "！", "，", "、", "；", "：", "～", "·", "।", "،", "۔", "؛", "٪"]
# spaCy puts its PUNCT alternation and "(?:quotes)" inside a character class before a suffix ".", so the class
# holds every character of them, "|", "(", "?", ":" and ")" included.
_PQ = re.escape("".join(sorted(set("".join(_PUNCT).replace("\\", "") + "|(?:)" + _QUOTES))))
_ELLIPSES = [r"\.\.+", "…"]
# spaCy's _other_symbols (char_classes.py): dingbats, arrows, emoji, ...
_ICONS = ["[" + (
    r"\u00A6\u00A9\u00AE\u00B0\u0482\u058D\u058E\u060E\u060F\u06DE\u06E9\u06FD\u06FE\u07F6\u09FA\u0B70"
    r"\u0BF3-\u0BF8\u0BFA\u0C7F\u0D4F\u0D79\u0F01-\u0F03\u0F13\u0F15-\u0F17\u0F1A-\u0F1F\u0F34\u0F36\u0F38"
    r"\u0FBE-\u0FC5\u0FC7-\u0FCC\u0FCE\u0FCF\u0FD5-\u0FD8\u109E\u109F\u1390-\u1399\u1940\u19DE-\u19FF"
    r"\u1B61-\u1B6A\u1B74-\u1B7C\u2100\u2101\u2103-\u2106\u2108\u2109\u2114\u2116\u2117\u211E-\u2123\u2125"
    r"\u2127\u2129\u212E\u213A\u213B\u214A\u214C\u214D\u214F\u218A\u218B\u2195-\u2199\u219C-\u219F\u21A1\u21A2"
    r"\u21A4\u21A5\u21A7-\u21AD\u21AF-\u21CD\u21D0\u21D1\u21D3\u21D5-\u21F3\u2300-\u2307\u230C-\u231F"
    r"\u2322-\u2328\u232B-\u237B\u237D-\u239A\u23B4-\u23DB\u23E2-\u2426\u2440-\u244A\u249C-\u24E9\u2500-\u25B6"
    r"\u25B8-\u25C0\u25C2-\u25F7\u2600-\u266E\u2670-\u2767\u2794-\u27BF\u2800-\u28FF\u2B00-\u2B2F\u2B45\u2B46"
    r"\u2B4D-\u2B73\u2B76-\u2B95\u2B98-\u2BC8\u2BCA-\u2BFE\u2CE5-\u2CEA\u2E80-\u2E99\u2E9B-\u2EF3\u2F00-\u2FD5"
    r"\u2FF0-\u2FFB\u3004\u3012\u3013\u3020\u3036\u3037\u303E\u303F\u3190\u3191\u3196-\u319F\u31C0-\u31E3"
    r"\u3200-\u321E\u322A-\u3247\u3250\u3260-\u327F\u328A-\u32B0\u32C0-\u32FE\u3300-\u33FF\u4DC0-\u4DFF"
    r"\uA490-\uA4C6\uA828-\uA82B\uA836\uA837\uA839\uAA77-\uAA79\uFDFD\uFFE4\uFFE8\uFFED\uFFEE\uFFFC\uFFFD"
    r"\U00010137-\U0001013F\U00010179-\U00010189\U0001018C-\U0001018E\U00010190-\U0001019B\U000101A0"
    r"\U000101D0-\U000101FC\U00010877\U00010878\U00010AC8\U0001173F\U00016B3C-\U00016B3F\U00016B45\U0001BC9C"
    r"\U0001D000-\U0001D0F5\U0001D100-\U0001D126\U0001D129-\U0001D164\U0001D16A-\U0001D16C\U0001D183\U0001D184"
    r"\U0001D18C-\U0001D1A9\U0001D1AE-\U0001D1E8\U0001D200-\U0001D241\U0001D245\U0001D300-\U0001D356"
    r"\U0001D800-\U0001D9FF\U0001DA37-\U0001DA3A\U0001DA6D-\U0001DA74\U0001DA76-\U0001DA83\U0001DA85\U0001DA86"
    r"\U0001ECAC\U0001F000-\U0001F02B\U0001F030-\U0001F093\U0001F0A0-\U0001F0AE\U0001F0B1-\U0001F0BF"
    r"\U0001F0C1-\U0001F0CF\U0001F0D1-\U0001F0F5\U0001F110-\U0001F16B\U0001F170-\U0001F1AC"
    r"\U0001F1E6-\U0001F202\U0001F210-\U0001F23B\U0001F240-\U0001F248\U0001F250\U0001F251\U0001F260-\U0001F265"
    r"\U0001F300-\U0001F3FA\U0001F400-\U0001F6D4\U0001F6E0-\U0001F6EC\U0001F6F0-\U0001F6F9"
    r"\U0001F700-\U0001F773\U0001F780-\U0001F7D8\U0001F800-\U0001F80B\U0001F810-\U0001F847"
    r"\U0001F850-\U0001F859\U0001F860-\U0001F887\U0001F890-\U0001F8AD\U0001F900-\U0001F90B"
    r"\U0001F910-\U0001F93E\U0001F940-\U0001F970\U0001F973-\U0001F976\U0001F97A\U0001F97C-\U0001F9A2"
    r"\U0001F9B0-\U0001F9B9\U0001F9C0-\U0001F9C2\U0001F9D0-\U0001F9FF\U0001FA60-\U0001FA6D") + "]"]
_CURRENCY = r"\$|£|€|¥|฿|US\$|C\$|A\$|₽|﷼|₴|₠|₡|₢|₣|₤|₥|₦|₧|₨|₩|₪|₫|₭|₮|₯|₰|₱|₲|₳|₵|₶|₷|₸|₹|₺|₻|₼|₾|₿"
_UNITS = ("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz m/s km/h kmh "
          "mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K % км км² км³ м м² м³ дм дм² дм³ см см² см³ мм мм² мм³ нм "
          "кг г мг м/с км/ч кПа Па мбар Кб КБ кб Мб МБ мб Гб ГБ гб Тб ТБ тбكم كم² كم³ م م² م³ سم سم² سم³ مم مم² مم³ كم "
          "غرام جرام جم كغ ملغ كوب اكواب").replace(" ", "|")     # spaCy's _units, its missing space after "тб" too
_HYPHENS = "-|–|—|--|---|——|~"

_PREFIX = re.compile("|".join("^" + p for p in ["§", "%", "=", "—", "–", r"\+(?![0-9])", *_PUNCT, *_ELLIPSES,
                                                 *(re.escape(q) for q in _QUOTES), *_CURRENCY.split("|"), *_ICONS]))
_SUFFIX = re.compile("|".join(p + "$" for p in [
    *_PUNCT, *_ELLIPSES, *(re.escape(q) for q in _QUOTES), *_ICONS, "'s", "'S", "’s", "’S", "—", "–",
    r"(?<=[0-9])\+", r"(?<=°[FfCcKk])\.", rf"(?<=[0-9])(?:{_CURRENCY})", rf"(?<=[0-9])(?:{_UNITS})",
    rf"(?<=[0-9{_AL}%²\-\+{_PQ}])\.",
    rf"(?<=[{_AU}][{_AU}])\."]))
_INFIX = re.compile("|".join([
    *_ELLIPSES, *_ICONS, r"(?<=[0-9])[+\-\*^](?=[0-9-])", rf"(?<=[{_AL}{_Q}])\.(?=[{_AU}{_Q}])",
    rf"(?<=[{_A}]),(?=[{_A}])", rf"(?<=[{_A}0-9])(?:{_HYPHENS})(?=[{_A}])", rf"(?<=[{_A}0-9])[:<>=/](?=[{_A}])"]))
# spaCy's URL_MATCH (lang/tokenizer_exceptions.py): scheme optional, so "example.com" is one token.
_URL = re.compile(
    r"^(?:(?:[\w\+\-\.]{2,})://)?(?:\S+(?::\S*)?@)?(?:(?!(?:10|127)(?:\.\d{1,3}){3})(?!(?:169\.254|192\.168)"
    r"(?:\.\d{1,3}){2})(?!172\.(?:1[6-9]|2\d|3[0-1])(?:\.\d{1,3}){2})(?:[1-9]\d?|1\d\d|2[01]\d|22[0-3])"
    r"(?:\.(?:1?\d{1,2}|2[0-4]\d|25[0-5])){2}(?:\.(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4]))|(?:(?:[A-Za-z0-9\u00a1-\uffff]"
    rf"[A-Za-z0-9\u00a1-\uffff_-]{{0,62}})?[A-Za-z0-9\u00a1-\uffff]\.)+(?:[{_AL}]{{2,63}}))(?::\d{{2,5}})?"
    r"(?:[/?#]\S*)?$")
_WHITESPACE = re.compile(r"\S+")     # str.split() splits on the same characters as spaCy's isspace() test


def _special_cases() -> Dict[str, Tuple[str, ...]]:
    """spaCy's English tokenizer exceptions (lang/en/tokenizer_exceptions.py and the shared ones), by rule."""
    exc: Dict[str, Tuple[str, ...]] = {}

    def add(pieces: Tuple[str, ...], title: bool = True) -> None:
        for p in ([pieces, (pieces[0].title(), *pieces[1:])] if title else [pieces]):
            exc["".join(p)] = p
            exc["".join(p).replace("'", "")] = tuple(x.replace("'", "") for x in p)
    for orth in ("i", "I"):
        for tail in (("'m",), ("'m", "a")):
            add((orth, *tail), title=False)
    for pron in ("i", "you", "he", "she", "it", "we", "they"):
        for tail in (("'ll",), ("'ll", "'ve"), ("'d",), ("'d", "'ve")):
            add((pron, *tail))
    for pron in ("i", "you", "we", "they"):
        add((pron, "'ve"))
    for pron in ("you", "we", "they"):
        add((pron, "'re"))
    for pron in ("he", "she", "it"):
        add((pron, "'s"))
    for word in ("who", "what", "when", "where", "why", "how", "there", "that", "this", "these", "those"):
        tails = [("'ll",), ("'ll", "'ve"), ("'d",), ("'d", "'ve")]
        tails += [] if word in ("these", "those") else [("'s",)]
        tails += [] if word in ("that", "this") else [("'re",), ("'ve",)]
        for tail in tails:
            add((word, *tail))
    for verb in ("ca", "could", "do", "does", "did", "had", "may", "might", "must", "need", "ought", "sha", "should",
                 "wo", "would"):
        add((verb, "n't"))
        add((verb, "n't", "'ve"))
    for verb in ("could", "might", "must", "should", "would"):
        add((verb, "'ve"))
    for verb in ("ai", "are", "is", "was", "were", "have", "has", "dare"):
        add((verb, "n't"))
    for word in ("doin", "goin", "nothin", "nuthin", "havin", "lovin", "somethin"):
        for p in ((word,), (word.title(),)):
            exc[p[0]] = p
            exc[p[0] + "'"] = (p[0] + "'",)
    exc.update({"ol": ("ol",), "ol'": ("ol'",), "Ol": ("Ol",), "Ol'": ("Ol'",)})
    for word in ("em", "ll", "nuff"):
        exc[word] = (word,)
        exc["'" + word] = ("'" + word,)
    for h in range(1, 13):
        for period in ("a.m.", "am", "p.m.", "pm"):
            exc[f"{h}{period}"] = (str(h), period)
    exc.update({"cannot": ("can", "not"), "gonna": ("gon", "na"), "gotta": ("got", "ta"), "let's": ("let", "'s"),
                "c'mon": ("c'm", "on"), "y'all": ("y'", "all"), "yall": ("y", "all"), "how'd'y": ("how", "'d", "'y"),
                "i'ma": ("i", "'m", "a"), "ima": ("i", "m", "a"), "not've": ("not", "'ve"), "notve": ("not", "ve"),
                "Let's": ("Let", "'s"), "C'mon": ("C'm", "on"), "How'd'y": ("How", "'d", "'y"),
                "Not've": ("Not", "'ve"), "Notve": ("Not", "ve"),
                "Cannot": ("Can", "not"), "Gonna": ("Gon", "na"), "Gotta": ("Got", "ta")})
    for deg in "CFKcfk":
        exc[f"°{deg}."] = ("°", deg, ".")
    for word in ("Ill", "ill", "Its", "its", "Hell", "hell", "Shell", "shell", "Shed", "shed", "were", "Were", "Well",
                 "well", "Whore", "whore"):
        exc.pop(word, None)
    singles = (
        "' '' 'Cause 'Cos 'Coz 'Cuz 'S 'bout 'cause 'cos 'coz 'cuz 'd 'em 'll 'nuff 're 's -_- -__- ._. 0.0 0.o 0_0 "
        "0_o 8) 8-) 8-D 8D :'( :') :'-( :'-) :( :(( :((( :() :) :)) :))) :* :-( :-(( :-((( :-) :-)) :-))) :-* :-/ :-0 "
        ":-3 :-> :-D :-O :-P :-X :-] :-o :-p :-x :-| :-} :/ :0 :1 :3 :> :D :O :P :X :] :o :o) :p :x :| :} ;) ;-) "
        ";-D ;D ;_; <.< </3 <3 <33 <333 =( =) =/ =3 =D =[ =] =| >.< >.> >:( >:o @_@ (*_*) (-8 (-: (-; (-_-) (._.) "
        "(: (; (= (>_<) (^_^) (o: (¬_¬) )-: ): [-: [: [= ]= ^_^ ^__^ ^___^ XD XDD xD xDD O.O O.o O_O O_o V.V V_V "
        "o.0 o.O o.o o_0 o_O o_o v.v v_v Adm. Ak. Ala. Apr. Ariz. Ark. Aug. Bros. C++ Calif. Co. Colo. Conn. Corp. "
        "D.C. Dec. Del. E.G. E.g. Feb. Fla. Ga. Gen. Gov. I.E. I.e. Ia. Id. Ill. Inc. Ind. Jan. Jr. Jul. Jun. Kan. "
        "Kans. Ky. La. Ltd. Mar. Mass. Md. Messrs. Mich. Minn. Miss. Mo. Mont. Mr. Mrs. Ms. Mt. N.C. N.D. N.H. N.J. "
        "N.M. N.Y. Neb. Nebr. Nev. Nov. O'clock Oct. Okla. Ore. Pa. Ph.D. Prof. Rep. Rev. S.C. Sen. Sep. Sept. St. "
        "Dr. (ಠ_ಠ) (╯°□°）╯︵┻━┻ <space> ><(((*> \\\") \\n \\t ¯\\(ツ)/¯ ಠ_ಠ ಠ︵ಠ "
        "Tenn. Va. Wash. Wis. a.m. and/or co. e.g. i.e. o'clock p.m. v.s. vs. w/o Ma'am ma'am ä. ö. ü. — ’ ’’ "
        "a. b. c. d. e. f. g. h. i. j. k. l. m. n. o. p. q. r. s. t. u. v. w. x. y. z.")
    for s in singles.split():
        exc[s] = (s,)
    for key, pieces in list(exc.items()):
        if "'" in key:
            curly = key.replace("'", "’")
            exc.setdefault(curly, tuple(x.replace("'", "’") for x in pieces))
    exc.update({"‘S": ("‘S",), "‘s": ("‘s",)})
    return exc


SPECIAL: Dict[str, Tuple[str, ...]] = _special_cases()
_CACHE: Dict[str, Tuple[str, ...]] = {}
_CACHE_MAX = 200_000


def split_chunk(chunk: str, specials: Dict[str, Tuple[str, ...]] = SPECIAL) -> Tuple[str, ...]:
    """spaCy's Tokenizer._split_affixes + _attach_tokens on one whitespace-free chunk, then its special-case
    matcher: a special case that itself holds an affix (":)" , "Mr.") is merged back from its pieces."""
    special = specials.get(chunk)
    if special is not None:
        return special
    out = _split_affixes(chunk, specials)
    if len(out) > 1 and specials and _AFFIX_SPECIALS_FIRST.intersection(out):
        out = _merge_specials(out)
    return out


def _merge_specials(toks: Tuple[str, ...]) -> Tuple[str, ...]:
    """Runs of tokens that spell an affix-holding special case become its tokens; overlapping runs are settled as
    spaCy's _filter_special_spans does: longest first, then leftmost, a run whose first or last token is taken
    is dropped."""
    found = [(n, i) for i in range(len(toks)) for n in range(2, min(_AFFIX_SPECIALS_LONGEST, len(toks) - i) + 1)
             if toks[i:i + n] in _AFFIX_SPECIALS]
    taken: set = set()
    starts: Dict[int, int] = {}
    for n, i in sorted(found, key=lambda m: (-m[0], m[1])):
        if i not in taken and i + n - 1 not in taken:
            starts[i] = n
        taken.update(range(i, i + n))
    out: List[str] = []
    i = 0
    while i < len(toks):
        n = starts.get(i)
        if n:
            out.extend(SPECIAL[_AFFIX_SPECIALS[toks[i:i + n]]])
            i += n
        else:
            out.append(toks[i])
            i += 1
    return tuple(out)


def _split_affixes(chunk: str, specials: Dict[str, Tuple[str, ...]]) -> Tuple[str, ...]:
    SPECIAL = specials  # noqa: N806 - the same code runs with and without special cases, as in spaCy
    prefixes: List[str] = []
    suffixes: List[str] = []
    s, last = chunk, -1
    while s and len(s) != last:
        if s in SPECIAL:
            break
        last = len(s)
        m = _PREFIX.search(s)
        pre = m.end() if m else 0
        if pre and s[pre:] in SPECIAL:
            prefixes.append(s[:pre])
            s = s[pre:]
            break
        m = _SUFFIX.search(s[pre:]) if pre else _SUFFIX.search(s)
        suf = m.end() - m.start() if m else 0
        if suf and len(s) > suf and s[:-suf] in SPECIAL:
            suffixes.append(s[-suf:])
            s = s[:-suf]
            break
        if pre and suf and pre + suf <= len(s):
            prefixes.append(s[:pre])
            suffixes.append(s[-suf:])
            s = s[pre:-suf]
        elif pre:
            prefixes.append(s[:pre])
            s = s[pre:]
        elif suf:
            suffixes.append(s[-suf:])
            s = s[:-suf]
    out = prefixes
    if s:
        if s in SPECIAL:
            out.extend(SPECIAL[s])
        elif _URL.match(s):
            out.append(s)
        else:
            start = 0
            for m in _INFIX.finditer(s):
                a, b = m.span()
                if a == 0:
                    continue
                if a != start:
                    out.append(s[start:a])
                if a != b:
                    out.append(s[a:b])
                start = b
            if s[start:]:
                out.append(s[start:])
    out.extend(reversed(suffixes))
    return tuple(out)


# spaCy (faster_heuristics) gives its special-case matcher the special cases that hold a prefix, suffix or infix,
# as the pieces the affix rules alone cut them into.
_AFFIX_SPECIALS: Dict[Tuple[str, ...], str] = {}
for _key in SPECIAL:
    if _PREFIX.search(_key) or _SUFFIX.search(_key) or _INFIX.search(_key):
        _pieces = split_chunk(_key, {})
        if len(_pieces) > 1:
            _AFFIX_SPECIALS.setdefault(_pieces, _key)
_AFFIX_SPECIALS_FIRST = frozenset(p[0] for p in _AFFIX_SPECIALS)
_AFFIX_SPECIALS_LONGEST = max(map(len, _AFFIX_SPECIALS))


_SPACE_RUNS = re.compile(r"(\s+)")


def split_keeping_space(line: str) -> List[str]:
    """spaCy's tokens of a line, whitespace tokens included (as " "): a run of whitespace is a token unless it is a
    single " ", which spaCy attaches to the token before (a run starting with " " loses that first space)."""
    out: List[str] = []
    for i, part in enumerate(_SPACE_RUNS.split(line)):
        if i % 2:
            if part != " ":
                out.append(" ")
        elif part:
            out.extend(split_into_words(part))
    return out


def split_into_words(text: str) -> List[str]:
    """datatrove's `split_into_words(text, "en")`: spaCy English tokens, whitespace dropped."""
    words: List[str] = []
    cache = _CACHE
    for chunk in text.split():
        if chunk.isalpha() and chunk not in SPECIAL:      # most chunks: one plain word, no affix to peel
            words.append(chunk)
            continue
        toks = cache.get(chunk)
        if toks is None:
            toks = split_chunk(chunk)
            if len(cache) < _CACHE_MAX:
                cache[chunk] = toks
        words.extend(toks)
    return words
