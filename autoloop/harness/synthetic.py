"""The embedded default corpus: text in a made-up language, generated from a secret key.

The corpus must be learnable at once (a first run on a CPU learns visibly in a minute,
with no download) and must exist nowhere a sandbox can read: a corpus any sandbox could
rebuild (the interpreter's own standard library, the old default) can be scored by a
lookup of each window's prefix instead of by a model. So every random choice here, the
language's parameters *and* every document, comes from the key in the hidden cache folder
(autoloop/harness/corpus_key.py). This code is public and fixed; the key is not. A
proposal that reads this file and every training batch knows the language's *form*, and
can learn its parameters from the training text, which is the honest job; it cannot
reproduce a val or held-out document.

* The language's parameters come from sha256(label, key). Each document's randomness comes
  from sha256(label, key, split, index) of its own, so recovering the generator state of
  one document (numpy's PCG64 is not a cryptographic generator) says nothing of another's.
* Its statistics are fixed (the sizes and exponents below), only identities are drawn:
  which syllables make which words, which words follow which. So its entropy, and an
  honest model's val_bpb, is nearly the same whatever the key.

The language: a few thousand pseudo-words made of syllables, shorter when frequent, with
Zipfian frequencies; each word has its own short list of successors, mixed with the
document's topic; each word its own propensity to end a sentence or take a comma; proper
nouns (always capitalised) and numbers; documents are prose (a title, paragraphs wrapped at
the document's width) or outlines (a heading, items indented by depth, wrapped with a
hanging indent). A character-level model first learns the letters and syllables (fast), then
words, then which word follows which: a long tail for trials to find.

Generation is vectorised across the documents of a batch (the chain's step for all of them
at once); rendering the words into lines is a short Python loop per document. The whole
corpus (about 10 MB) takes a few seconds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

LANGUAGE_VERSION = 1

# Letters: a syllable is an onset, a nucleus and a coda, drawn with these fixed weights
# (the key picks which syllables make which word, not how letters are distributed: that
# would make the entropy per byte depend on the key).
ONSETS = {"": 8, "b": 5, "d": 6, "f": 3, "g": 3, "h": 4, "k": 5, "l": 6, "m": 5, "n": 7, "p": 4, "r": 6, "s": 7,
          "t": 8, "v": 2, "z": 1, "w": 3, "br": 1, "dr": 1, "fl": 1, "gr": 1, "kl": 1, "pl": 1, "st": 2, "tr": 2,
          "sh": 2, "ch": 1, "th": 3}
NUCLEI = {"a": 8, "e": 9, "i": 6, "o": 6, "u": 3, "ai": 1, "ou": 1, "ea": 1, "y": 1}
CODAS = {"": 24, "n": 5, "r": 4, "s": 4, "l": 3, "m": 2, "k": 1, "t": 3, "nd": 1, "st": 1}

VOCABULARY = 4096  # words, ranked by frequency
WORD_ZIPF, WORD_ZIPF_SHIFT = 1.05, 2.7  # p(rank r) ~ (r + shift)^-zipf
NUMBER_RANK = 40  # the word that is written as a number
PROPER_FROM_RANK, PROPER_SHARE = 200, 0.05  # rarer words: this share is always capitalised

SUCCESSORS = 24  # each word's own successors (drawn by frequency), weighted (j + 1)^-SUCCESSOR_ZIPF
SUCCESSOR_ZIPF = 1.2
P_SUCCESSOR = 0.72  # the next word is one of the previous word's successors; else the topic's mix
TOPICS, TOPIC_WORDS, P_TOPIC = 32, 128, 0.4  # a topic boosts its own words in the fallback mix
SENTENCE_STARTS = 96  # the words a sentence starts with, Zipf-weighted
END_RANGE = (0.01, 0.17)  # each word's chance of ending a sentence, drawn uniformly in this range
COMMA_RANGE = (0.0, 0.12)  # ... and of being followed by a comma
MAX_SENTENCE = 40  # words: a longer sentence is ended

WORDS_PER_DOCUMENT = (120, 900)  # uniform, inclusive
P_OUTLINE = 0.3  # documents that are outlines; the others are prose
P_PARAGRAPH = 0.25  # a prose paragraph ends after a sentence with this chance
WIDTHS = (64, 72, 80)  # a document's line width
TITLE_WORDS = 6  # a title is the first sentence's first words
MAX_DEPTH = 3  # outline indentation levels (two spaces each)
BATCH = 512  # documents generated side by side


def _digest(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(4, "big") + part)  # length-prefixed: no two part lists collide
    return h.digest()


def _rng(seed: bytes) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(int.from_bytes(seed, "big")))


def document_seed(key: bytes, split: str, index: int) -> bytes:
    """The 256-bit seed of one document: sha256 of the key, the split and the index."""
    return _digest(b"autoloop synthetic document", LANGUAGE_VERSION.to_bytes(2, "big"), key, split.encode(),
                   index.to_bytes(8, "big"))


def _zipf(n: int, exponent: float, shift: float = 1.0) -> np.ndarray:
    p = (np.arange(n) + shift) ** -exponent
    return p / p.sum()


def _cdf(p: np.ndarray) -> np.ndarray:
    c = np.cumsum(p, axis=-1)
    c[..., -1] = 1.0  # rounding must never leave a uniform draw past the end
    return c


def _spellings(rng: np.random.Generator, parts: list, lengths: list[int] | None = None) -> list[str]:
    """VOCABULARY distinct word forms by rank, shortest first: frequent words are short, as in
    natural languages (1 syllable at the top, ~2.4 in the tail). With `lengths`, the form of
    rank r is drawn again until it has lengths[r] letters."""

    def syllables(count: int) -> str:
        u = rng.random((count, 3))
        return "".join(names[np.searchsorted(cdf, u[i, j], side="right")]
                       for i in range(count) for j, (names, cdf) in enumerate(parts))

    forms: list[str] = []
    seen: set[str] = set()
    for rank in range(VOCABULARY):
        q = min(0.8, 0.2 * np.log10(rank + 1))
        while True:
            form = syllables(1 + int(rng.binomial(2, q)))
            if form not in seen and (lengths is None or len(form) == lengths[rank]):
                break
        seen.add(form)
        forms.append(form)
    # The shortest forms to the most frequent ranks.
    return sorted(forms, key=len) if lengths is None else forms


@dataclass
class Language:
    """The parameters a key gives: spellings, successors, topics, punctuation propensities."""

    forms: list[str]  # by rank; the number word's form is a placeholder
    capitals: list[str]  # the form a word takes at the start of a sentence (proper nouns: always)
    successors: np.ndarray  # (VOCABULARY, SUCCESSORS) word ids
    successor_cdf: np.ndarray  # (SUCCESSORS,) the same weights by position for every word
    topic_cdf: np.ndarray  # (TOPICS, VOCABULARY)
    start_words: np.ndarray  # (SENTENCE_STARTS,)
    start_cdf: np.ndarray
    p_end: np.ndarray  # (VOCABULARY,)
    p_comma: np.ndarray

    @classmethod
    def from_key(cls, key: bytes) -> "Language":
        rng = _rng(_digest(b"autoloop synthetic language", LANGUAGE_VERSION.to_bytes(2, "big"), key))
        parts = [(list(table), _cdf(np.array(list(table.values()), dtype=float) / sum(table.values())))
                 for table in (ONSETS, NUCLEI, CODAS)]

        # Every key spells its words with the same lengths, rank by rank (a profile drawn
        # once, from no key): bytes per word, and so an honest model's bits per byte, then do
        # not move with the key; with free lengths the corpus's size moved by +-4%, and its
        # val_bpb with it.
        lengths = [len(f) for f in _spellings(_rng(_digest(b"autoloop synthetic lengths",
                                                             LANGUAGE_VERSION.to_bytes(2, "big"))), parts)]
        forms = _spellings(rng, parts, lengths)
        forms[NUMBER_RANK] = "#"
        proper = (np.arange(VOCABULARY) >= PROPER_FROM_RANK) & (rng.random(VOCABULARY) < PROPER_SHARE)
        forms = [f.capitalize() if is_proper else f for f, is_proper in zip(forms, proper)]
        capitals = [f.capitalize() for f in forms]

        unigram = _zipf(VOCABULARY, WORD_ZIPF, WORD_ZIPF_SHIFT)
        unigram_cdf = _cdf(unigram)
        successors = np.searchsorted(unigram_cdf, rng.random((VOCABULARY, SUCCESSORS)), side="right")
        topics = np.empty((TOPICS, VOCABULARY))
        for t in range(TOPICS):
            own = rng.choice(np.arange(PROPER_FROM_RANK // 2, VOCABULARY), TOPIC_WORDS, replace=False)
            topics[t] = (1 - P_TOPIC) * unigram
            topics[t, own] += P_TOPIC / TOPIC_WORDS
        start_words = np.searchsorted(unigram_cdf, rng.random(SENTENCE_STARTS), side="right")
        return cls(
            forms=forms, capitals=capitals, successors=successors.astype(np.int64),
            successor_cdf=_cdf(_zipf(SUCCESSORS, SUCCESSOR_ZIPF)), topic_cdf=_cdf(topics),
            start_words=start_words.astype(np.int64), start_cdf=_cdf(_zipf(SENTENCE_STARTS, 1.0)),
            p_end=rng.uniform(*END_RANGE, VOCABULARY), p_comma=rng.uniform(*COMMA_RANGE, VOCABULARY),
        )


@dataclass
class _Draws:
    """Everything random about one document, drawn from its own generator in a fixed order."""

    outline: bool
    width: int
    n: int
    mode: np.ndarray  # per word: < P_SUCCESSOR takes a successor
    pick: np.ndarray  # which successor
    fallback: np.ndarray  # the word if not a successor (the topic's mix)
    start: np.ndarray  # the word if a sentence starts here
    end: np.ndarray  # < p_end[word] ends the sentence
    comma: np.ndarray
    mark: np.ndarray  # the sentence's final mark
    paragraph: np.ndarray  # prose: < P_PARAGRAPH ends the paragraph
    depth: np.ndarray  # outline: the item's indentation move
    numbers: np.ndarray  # the value of a number word here

    @classmethod
    def draw(cls, lang: Language, seed: bytes, index: int) -> "_Draws":
        rng = _rng(seed)
        # A document's shape (prose or outline, width, topic, length) follows its index, not
        # the key: the few documents the CPU evaluation reads are then the same mix whatever
        # the key, and the key moves the honest val_bpb by the language alone. Its words do
        # follow the key.
        outline = (index * 7) % 10 < round(P_OUTLINE * 10)
        width = WIDTHS[index % len(WIDTHS)]
        topic = (index * 5) % TOPICS
        low, high = WORDS_PER_DOCUMENT
        n = low + int(((index * 0.6180339887498949) % 1.0) * (high - low + 1))
        u = rng.random((6, n))
        return cls(
            outline=outline, width=width, n=n, mode=u[0], pick=np.searchsorted(lang.successor_cdf, u[1], side="right"),
            fallback=np.searchsorted(lang.topic_cdf[topic], u[2], side="right"),
            start=lang.start_words[np.searchsorted(lang.start_cdf, u[3], side="right")], end=u[4], comma=u[5],
            mark=rng.random(n), paragraph=rng.random(n), depth=rng.integers(-1, 2, n),
            # Numbers: 1 to 4 digits, log-uniform, as counts and years are.
            numbers=np.floor(10 ** rng.uniform(0, 4, n)).astype(np.int64),
        )


def _chain(lang: Language, docs: list[_Draws]) -> tuple[np.ndarray, np.ndarray]:
    """The word ids and sentence ends of every document, one step for all documents at once."""
    width = max(d.n for d in docs)
    shape = (len(docs), width)

    def padded(name: str, dtype) -> np.ndarray:
        out = np.zeros(shape, dtype=dtype)
        for i, d in enumerate(docs):
            out[i, : d.n] = getattr(d, name)
        return out

    mode, pick, fallback = padded("mode", np.float64), padded("pick", np.int64), padded("fallback", np.int64)
    start, end_u = padded("start", np.int64), padded("end", np.float64)
    last = np.array([d.n - 1 for d in docs])
    words = np.zeros(shape, dtype=np.int64)
    ends = np.zeros(shape, dtype=bool)
    length = np.ones(len(docs), dtype=np.int64)  # words so far in the current sentence
    for t in range(width):
        if t == 0:
            w = start[:, 0]
        else:
            prev = words[:, t - 1]
            chosen = np.where(mode[:, t] < P_SUCCESSOR, lang.successors[prev, pick[:, t]], fallback[:, t])
            w = np.where(ends[:, t - 1], start[:, t], chosen)
            length = np.where(ends[:, t - 1], 1, length + 1)
        words[:, t] = w
        ends[:, t] = (end_u[:, t] < lang.p_end[w]) | (length >= MAX_SENTENCE) | (t == last)
    return words, ends


def _sentences(lang: Language, d: _Draws, words: np.ndarray, ends: np.ndarray) -> list[list[str]]:
    """Each sentence as its tokens (a word with its comma or final mark attached)."""
    sentences, current = [], []
    forms, capitals, p_comma = lang.forms, lang.capitals, lang.p_comma
    for t in range(d.n):
        w = int(words[t])
        if w == NUMBER_RANK:
            token = str(int(d.numbers[t]))
        else:
            token = capitals[w] if not current else forms[w]
        if ends[t]:
            m = d.mark[t]
            token += "." if m < 0.8 else "?" if m < 0.92 else "!"
            current.append(token)
            sentences.append(current)
            current = []
        else:
            if d.comma[t] < p_comma[w]:
                token += ","
            current.append(token)
    return sentences


def _wrap(tokens: list[str], width: int, first: str, rest: str, out: list[str]) -> None:
    line, size = [first], len(first)
    fresh = True
    for token in tokens:
        if not fresh and size + 1 + len(token) > width:
            out.append("".join(line))
            line, size, fresh = [rest], len(rest), True
        if fresh:
            line.append(token)
            size += len(token)
            fresh = False
        else:
            line.append(" " + token)
            size += 1 + len(token)
    out.append("".join(line))


def _render(lang: Language, d: _Draws, words: np.ndarray, ends: np.ndarray) -> bytes:
    sentences = _sentences(lang, d, words, ends)
    title = " ".join(tok.rstrip(".,?!").capitalize() for tok in sentences[0][:TITLE_WORDS])
    lines: list[str] = [title + ":" if d.outline else title, ""]
    body = sentences[1:]
    if d.outline:
        depth = 0
        for i, sentence in enumerate(body):
            depth = 0 if i == 0 else min(MAX_DEPTH, max(0, depth + int(d.depth[i])))
            indent = "  " * depth
            _wrap(sentence, d.width, indent + "- ", indent + "  ", lines)
    else:
        paragraph: list[str] = []
        for i, sentence in enumerate(body):
            paragraph.extend(sentence)
            if d.paragraph[i] < P_PARAGRAPH or i == len(body) - 1:
                _wrap(paragraph, d.width, "", "", lines)
                lines.append("")
                paragraph = []
    return ("\n".join(lines).rstrip("\n") + "\n").encode("ascii")


def generate(key: bytes, split: str, count: int, *, language: Language | None = None) -> Iterator[bytes]:
    """The `count` documents of `split`, in order (document i depends on the key, the split and i only)."""
    lang = language or Language.from_key(key)
    for first in range(0, count, BATCH):
        docs = [_Draws.draw(lang, document_seed(key, split, i), i) for i in range(first, min(count, first + BATCH))]
        words, ends = _chain(lang, docs)
        for i, d in enumerate(docs):
            yield _render(lang, d, words[i, : d.n], ends[i, : d.n])
