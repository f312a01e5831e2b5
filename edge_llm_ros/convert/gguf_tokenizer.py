"""Build a Hugging Face `tokenizers` tokenizer from the vocabulary stored in a GGUF file.

The result must tokenize exactly like llama.cpp does with the same GGUF, because the weights were
trained on those ids.  The metadata keys are the `tokenizer.ggml.*` ones written by llama.cpp's
converter; the pre-tokenizer regexes per `tokenizer.ggml.pre` follow llama.cpp's llama-vocab.cpp
(the original Hugging Face patterns, since `tokenizers` understands `(?i:...)`).

Three vocabulary kinds are supported:
- 'gpt2': byte-level BPE (tokens, merges, token types) with a regex pre-tokenizer.
- 'llama': SentencePiece-style vocabulary (pieces with '▁', scores, <0xXX> byte tokens).  llama.cpp
  merges the best-scoring adjacent pair whose concatenation is a piece; that is BPE whose merge
  ranks follow the merged piece's score, so the merges are derived from the scores.
- 'bert': WordPiece (WPM) as llama.cpp stores it: word-initial pieces carry '▁', continuation
  pieces are bare; the text is lowercased (accents stripped) unless the GGUF says otherwise,
  split at whitespace and punctuation, and every word matched greedily, longest piece first,
  a word with no match becoming [UNK]; [CLS] text [SEP].
- 't5': SentencePiece unigram (UGM: XLM-RoBERTa's vocabulary in bge-m3, bge-reranker-v2-m3,
  multilingual-e5), as llama.cpp's llm_tokenizer_ugm: the GGUF's precompiled charsmap, its
  space handling (space prefix, extra spaces merged), then a Viterbi over the whole text with
  the pieces' scores; a code point no piece covers is [UNK] at the lowest normal score - 10,
  runs of them merged; <s> text </s>.
"""
from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gguf
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, Regex
from tokenizers import processors, Tokenizer

from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

_LOG = logging.getLogger(__name__)


# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Used only when the GGUF carries no tokenizer.chat_template (logged when it happens).
DEFAULT_CHATML_TEMPLATE = (
    '{% for message in messages %}'
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    '{% endfor %}'
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# --- pre-tokenizer regexes (each applied in turn, matches and gaps both kept) -----------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept inside words.
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r'| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+')
_GPT4O = (r'[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+'
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r'|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*'
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r'|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+')

# family -> (regexes, ignore_merges, add_bos default when the GGUF does not say)
_FAMILIES: Dict[str, Tuple[Tuple[str, ...], bool, bool]] = {
    'gpt2': ((_GPT2,), False, False),
    'starcoder': ((r'\p{N}', _GPT2), False, False),
    'llama3': ((_LLAMA3,), True, True),
    'dbrx': ((_LLAMA3,), False, False),
    'qwen2': ((_QWEN2,), False, False),
    'qwen35': ((_QWEN35,), False, False),
    'gpt4o': ((_GPT4O,), False, False),
    'default': ((r'[\p{P}\$\+<=>\^~\|]+', _GPT2, r'\p{N}+', '[0-9][0-9][0-9]'), False, False),
}

# tokenizer.ggml.pre -> family, as llama.cpp maps them.
_PRE_FAMILY: Dict[str, str] = {
    'default': 'default',
    'gpt-2': 'gpt2', 'phi-2': 'gpt2', 'mpt': 'gpt2', 'olmo': 'gpt2', 'jais': 'gpt2',
    'exaone4': 'gpt2', 'jina-es': 'gpt2', 'jina-de': 'gpt2', 'gigachat': 'gpt2',
    'modern-bert': 'gpt2',
    'smollm': 'starcoder', 'starcoder': 'starcoder', 'refact': 'starcoder',
    'command-r': 'starcoder', 'codeshell': 'starcoder', 'exaone': 'starcoder',
    'minerva-7b': 'starcoder',
    'llama3': 'llama3', 'llama-v3': 'llama3', 'llama-bpe': 'llama3', 'falcon3': 'llama3',
    'pixtral': 'llama3', 'lfm2': 'llama3',
    'dbrx': 'dbrx', 'smaug-bpe': 'dbrx',
    'qwen2': 'qwen2', 'deepseek-r1-qwen': 'qwen2', 'stablelm2': 'qwen2', 'megrez': 'qwen2',
    'qwen35': 'qwen35',
    'gpt-4o': 'gpt4o', 'llama4': 'gpt4o',
}

# Token texts llama.cpp also treats as end of generation (besides eos/eot/eom ids).
_EOG_TEXTS = frozenset((
    '<|eot_id|>', '<|im_end|>', '<|end|>', '<end_of_turn>', '<|endoftext|>', '<|eom_id|>',
    '<EOT>', '_<EOT>', '<|end_of_text|>', '<end_of_utterance>',
))


def write_tokenizer_files(reader: gguf.GGUFReader, out_dir: os.PathLike) -> Dict[str, Any]:
    """Write tokenizer.json and chat_template.jinja for the GGUF's vocabulary into `out_dir`.

    Returns the special-token facts model.yaml needs: bos_token_id, eos_token_ids,
    add_bos_token, add_eos_token, pad_token_id, unk_token_id, vocab_size, tokenizer_model,
    tokenizer_pre, chat_template_source ('gguf' or 'default-chatml').
    Raises UnsupportedModelError for vocabulary kinds that cannot be reproduced exactly and
    ModelLoadError when the metadata is incomplete.
    """
    meta = _Metadata(reader)
    tokenizer, info = build_tokenizer(meta)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / TOKENIZER_FILE))

    template = meta.get('tokenizer.chat_template')
    if template:
        info['chat_template_source'] = 'gguf'
    else:
        _LOG.warning('GGUF has no tokenizer.chat_template; writing a default ChatML template')
        template = DEFAULT_CHATML_TEMPLATE
        info['chat_template_source'] = 'default-chatml'
    (out / CHAT_TEMPLATE_FILE).write_text(template, encoding='utf-8')
    return info


def build_tokenizer(meta: '_Metadata') -> Tuple[Tokenizer, Dict[str, Any]]:
    """Build the tokenizer and its special-token facts from GGUF metadata."""
    kind = meta.get('tokenizer.ggml.model')
    if kind is None:
        raise ModelLoadError('GGUF has no tokenizer.ggml.model: the file carries no vocabulary')
    tokens = meta.require('tokenizer.ggml.tokens')
    types = meta.get('tokenizer.ggml.token_type') or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError('GGUF tokenizer.ggml.token_type and tokens differ in length')

    if kind == 'gpt2':
        pre = meta.get('tokenizer.ggml.pre')
        if not pre:
            _LOG.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                         'pre-tokenizer (the model may tokenize worse than intended)')
            pre = 'default'
        tokenizer, add_bos_default = _byte_level_bpe(tokens, meta, pre)
        add_space_prefix = False
    elif kind == 'gemma4':
        pre = 'gemma4'
        tokenizer = _gemma4_bpe(tokens, meta)
        add_space_prefix = False
        add_bos_default = False
    elif kind == 'llama':
        pre = meta.get('tokenizer.ggml.pre') or 'default'
        add_space_prefix = bool(meta.get('tokenizer.ggml.add_space_prefix', True))
        tokenizer = _sentencepiece_bpe(tokens, types, meta, add_space_prefix)
        add_bos_default = True
    elif kind == 'bert':
        pre = meta.get('tokenizer.ggml.pre') or 'default'
        tokenizer = _wordpiece(tokens, meta)
        add_bos_default, add_space_prefix = True, False
    elif kind == 't5':
        pre = meta.get('tokenizer.ggml.pre') or 'default'
        add_space_prefix = bool(meta.get('tokenizer.ggml.add_space_prefix', False))
        tokenizer = _unigram(tokens, types, meta, add_space_prefix)
        add_bos_default = False
    else:
        raise UnsupportedModelError(
            f'tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), '
            'llama (SentencePiece), gemma4 (SentencePiece-style BPE with merges), bert '
            '(WordPiece), t5 (SentencePiece unigram)')

    _register_added_tokens(tokenizer, tokens, types)

    bos = _optional_id(meta, 'tokenizer.ggml.bos_token_id', len(tokens))
    eos = _optional_id(meta, 'tokenizer.ggml.eos_token_id', len(tokens))
    # Without the key, llama.cpp's per-vocabulary default applies (when a BOS id exists).
    add_bos = bool(meta.get('tokenizer.ggml.add_bos_token', add_bos_default and bos is not None))
    add_eos = bool(meta.get('tokenizer.ggml.add_eos_token', kind == 't5'))
    sep = None
    if kind == 't5':
        # llama.cpp's UGM defaults: eos 1, unk 2; a pair is <s> a </s> [sep] b </s>.
        if eos is None and meta.get('tokenizer.ggml.eos_token_id') is None:
            eos = 1 if len(tokens) > 1 else None
        if meta.get('tokenizer.ggml.add_sep_token', False):
            sep = _optional_id(meta, 'tokenizer.ggml.seperator_token_id', len(tokens))
    if kind == 'bert' and meta.get('tokenizer.ggml.add_sep_token', True):
        # llama.cpp appends the separator (not eos) to a WPM text: [CLS] text [SEP].
        eos = _optional_id(meta, 'tokenizer.ggml.seperator_token_id', len(tokens))
        if eos is None:
            raise ModelLoadError('GGUF bert vocabulary has no tokenizer.ggml.seperator_token_id')
        add_eos = True
    if add_bos and bos is None:
        raise ModelLoadError('GGUF sets add_bos_token but has no tokenizer.ggml.bos_token_id')
    if add_eos and eos is None:
        raise ModelLoadError('GGUF sets add_eos_token but has no tokenizer.ggml.eos_token_id')
    _set_post_processor(tokenizer, tokens, bos if add_bos else None, eos if add_eos else None,
                        sep)

    info: Dict[str, Any] = {
        'tokenizer_model': kind,
        'tokenizer_pre': pre,
        'vocab_size': len(tokens),
        'bos_token_id': bos,
        'eos_token_ids': _eog_ids(meta, tokens, eos),
        'add_bos_token': add_bos,
        'add_eos_token': add_eos,
        'add_space_prefix': add_space_prefix,
        'pad_token_id': _optional_id(meta, 'tokenizer.ggml.padding_token_id', len(tokens)),
        'unk_token_id': _optional_id(meta, 'tokenizer.ggml.unknown_token_id', len(tokens)),
    }
    return tokenizer, info


class _Metadata:
    """Typed access to the GGUF key/value fields."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f'GGUF metadata lacks {key}; re-export the model with a '
                                 'current llama.cpp converter')
        return value


def _byte_level_bpe(tokens: Sequence[str], meta: _Metadata, pre: str) -> Tuple[Tokenizer, bool]:
    family = _PRE_FAMILY.get(pre)
    if family is None:
        raise UnsupportedModelError(
            f'GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(_PRE_FAMILY)}')
    regexes, ignore_merges, add_bos_default = _FAMILIES[family]
    merges = [_split_merge(m) for m in meta.require('tokenizer.ggml.merges')]
    model = models.BPE(vocab=_vocab_dict(tokens), merges=merges, ignore_merges=ignore_merges,
                       fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(model)
    # llama.cpp splits with each regex in turn and keeps the gaps: 'isolated' does the same.
    splits = [pre_tokenizers.Split(Regex(r), behavior='isolated') for r in regexes]
    steps = splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    vocab = set(tokens)
    missing = sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab)
    if missing:
        # A byte the vocabulary lacks stays a symbol of its own in llama.cpp (then dropped),
        # so its neighbours never merge across it; isolating it keeps them apart here too.
        chars = ''.join(f'\\x{{{ord(c):X}}}' for c in missing)
        steps.append(pre_tokenizers.Split(Regex(f'[{chars}]'), behavior='isolated'))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, add_bos_default


def _sentencepiece_bpe(tokens: Sequence[str], types: Sequence[int], meta: _Metadata,
                       add_space_prefix: bool) -> Tokenizer:
    scores = meta.require('tokenizer.ggml.scores')
    if len(scores) != len(tokens):
        raise ModelLoadError('GGUF tokenizer.ggml.scores and tokens differ in length')
    unk_id = _optional_id(meta, 'tokenizer.ggml.unknown_token_id', len(tokens))
    merges = _merges_from_scores(tokens, types, scores)
    model = models.BPE(vocab=_vocab_dict(tokens), merges=merges,
                       unk_token=tokens[unk_id] if unk_id is not None else None,
                       fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    # llama.cpp prefixes a space to every text fragment that follows a special token (or starts
    # the text); normalizers run per fragment between added tokens, so Prepend does the same.
    steps = [normalizers.Prepend('▁')] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(' ', '▁')])
    dec = [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(' ', 1, 0))
    tokenizer.decoder = decoders.Sequence(dec)
    return tokenizer


def _gemma4_bpe(tokens: Sequence[str], meta: _Metadata) -> Tokenizer:
    """Gemma 4's vocabulary as llama.cpp reads it (tokenizer model 'gemma4').

    Spaces become '▁', the text is split only at newlines, and BPE merges (the GGUF's) run on
    raw UTF-8 with <0xXX> byte pieces for the rest; no space is prefixed.
    """
    merges = [_split_merge(m) for m in meta.require('tokenizer.ggml.merges')]
    model = models.BPE(vocab=_vocab_dict(tokens), merges=merges, byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(' ', '▁')
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex('[^\n]+|[\n]+'), 'isolated')
    tokenizer.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(),
                                           decoders.Fuse()])
    return tokenizer


def _merges_from_scores(tokens: Sequence[str], types: Sequence[int],
                        scores: Sequence[float]) -> List[Tuple[str, str]]:
    """Derive BPE merges: every split of a normal piece into two pieces, best score first."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    candidates = []
    for piece, idx in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                candidates.append((-scores[idx], idx, left, right))
    candidates.sort()
    return [(left, right) for _, _, left, right in candidates]


def _wordpiece(tokens: Sequence[str], meta: _Metadata) -> Tokenizer:
    """Return WordPiece over the GGUF's WPM vocabulary, normalized and split as llama.cpp's WPM."""
    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t.startswith('[') and t.endswith(']'):
            piece = t
        elif t.startswith('\u2581'):
            piece = t[1:]
        else:
            piece = '##' + t
        vocab.setdefault(piece, i)
    unk_id = _optional_id(meta, 'tokenizer.ggml.unknown_token_id', len(tokens))
    if unk_id is None:
        raise ModelLoadError('GGUF bert vocabulary has no tokenizer.ggml.unknown_token_id')
    lowercase = bool(meta.get('tokenizer.ggml.normalizer.lowercase', True))
    strip = bool(meta.get('tokenizer.ggml.normalizer.strip_accents', lowercase))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=tokens[unk_id],
                                           max_input_chars_per_word=1 << 20))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def _unigram(tokens: Sequence[str], types: Sequence[int], meta: _Metadata,
             add_space_prefix: bool) -> Tokenizer:
    """Return a unigram tokenizer that segments as llama.cpp's UGM does (module docstring).

    llama.cpp's Viterbi sees normal, user-defined (score 0) and unused pieces only, and scores
    an unknown code point at the lowest *normal* score - 10; `tokenizers` takes the lowest
    score of all pieces. So control/unknown/byte pieces become unmatchable placeholders (they
    are matched as added tokens instead) at the lowest normal score, which leaves that floor
    where llama.cpp has it.
    """
    scores = meta.get('tokenizer.ggml.scores') or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ModelLoadError('GGUF tokenizer.ggml.scores and tokens differ in length')
    normal = [float(s) for s, k in zip(scores, types) if k == TOKEN_NORMAL]
    if not normal:
        raise ModelLoadError('GGUF t5 vocabulary has no normal pieces')
    floor = min(normal)
    unk_id = _optional_id(meta, 'tokenizer.ggml.unknown_token_id', len(tokens))
    unk_id = 2 if unk_id is None and len(tokens) > 2 else unk_id   # llama.cpp's UGM default
    if unk_id is None:
        raise ModelLoadError('GGUF t5 vocabulary has no tokenizer.ggml.unknown_token_id')
    pieces = []
    for i, (text, kind, score) in enumerate(zip(tokens, types, scores)):
        if kind in (TOKEN_NORMAL, TOKEN_UNUSED):
            pieces.append((text, float(score)))
        elif kind == TOKEN_USER_DEFINED:
            pieces.append((text, 0.0))
        else:   # \U000f0000: a private-use plane never produced by the charsmap
            pieces.append((f'\U000f0000{i}\U000f0000', floor))
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id, False))
    space = '\u2581' if meta.get('tokenizer.ggml.escape_whitespaces', True) else ' '
    steps = []
    charsmap = meta.get('tokenizer.ggml.precompiled_charsmap')
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap)))
    if meta.get('tokenizer.ggml.remove_extra_whitespaces', False):
        # Every run of non-spaces gets one space before it: no leading, trailing or repeated
        # spaces, one in front.
        steps += [normalizers.Replace(Regex('^ +| +$'), ''), normalizers.Replace(Regex(' +'), ' '),
                  normalizers.Prepend(' ')]
    elif add_space_prefix:
        # A space before the first non-space (llama.cpp); a text of spaces only gets one
        # more here than there.
        steps.append(normalizers.Prepend(' '))
    steps.append(normalizers.Replace(' ', space))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Metaspace(replacement='\u2581', prepend_scheme='always')
    return tokenizer


def _register_added_tokens(tokenizer: Tokenizer, tokens: Sequence[str],
                           types: Sequence[int]) -> None:
    # Control tokens are matched in the text as specials (llama.cpp parse_special); user-defined
    # ones are always matched but are ordinary text when decoding.
    control = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def _set_post_processor(tokenizer: Tokenizer, tokens: Sequence[str], bos: Optional[int],
                        eos: Optional[int], sep: Optional[int] = None) -> None:
    """Add bos/eos around a text; a pair (rerank) is bos a eos [sep] b eos, as llama-server."""
    if bos is None and eos is None:
        return
    head = f'{tokens[bos]} ' if bos is not None else ''
    tail = f' {tokens[eos]}' if eos is not None else ''
    middle = f' {tokens[sep]}' if sep is not None else ''
    specials = [(tokens[i], i) for i in {bos, eos, sep} if i is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f'{head}$A{tail}', pair=f'{head}$A{tail}{middle} $B{tail}',
        special_tokens=specials)


def _vocab_dict(tokens: Sequence[str]) -> Dict[str, int]:
    vocab: Dict[str, int] = {}
    duplicates = 0
    for i, t in enumerate(tokens):
        if t in vocab:
            duplicates += 1
            continue
        vocab[t] = i
    if duplicates:
        _LOG.warning('GGUF vocabulary repeats %d token texts; the later ids cannot be produced '
                     'by encoding', duplicates)
    return vocab


def _split_merge(merge: str) -> Tuple[str, str]:
    left, sep, right = merge.partition(' ')
    if not sep or not left or not right:
        raise ModelLoadError(f'GGUF merge {merge!r} is not two space-separated tokens')
    return left, right


def _optional_id(meta: _Metadata, key: str, vocab_size: int) -> Optional[int]:
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < vocab_size:
        raise ModelLoadError(f'GGUF {key}={value} is outside the vocabulary (size {vocab_size})')
    return value


def _eog_ids(meta: _Metadata, tokens: Sequence[str], eos: Optional[int]) -> List[int]:
    """All ids that end generation, eos first, as llama.cpp collects them."""
    ids: List[int] = [eos] if eos is not None else []
    for key in ('tokenizer.ggml.eot_token_id', 'tokenizer.ggml.eom_token_id'):
        value = _optional_id(meta, key, len(tokens))
        if value is not None and value not in ids:
            ids.append(value)
    for i, text in enumerate(tokens):
        if text in _EOG_TEXTS and i not in ids:
            ids.append(i)
    return ids
