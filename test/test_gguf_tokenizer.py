"""GGUF vocabulary -> tokenizer.json: ids must equal llama.cpp's tokenization of the same GGUF.

The reference is a direct Python transcription of llama.cpp's algorithms (regex split per
tokenizer.ggml.pre, GPT-2 byte mapping, rank-ordered merges; SentencePiece bigram merging by
score with byte fallback), run on the GGUF's own vocabulary.
"""
import heapq
import json

import gguf
from hypothesis import given, HealthCheck, settings, strategies as st
import pytest
import regex
from smollm2_files import smollm2_gguf, write_text_model_dir
from tokenizers import Tokenizer

from edge_llm_ros.convert.gguf_tokenizer import DEFAULT_CHATML_TEMPLATE, write_tokenizer_files
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import CHAT_TEMPLATE_FILE, TOKENIZER_FILE

# llama.cpp's regexes for tokenizer.ggml.pre == 'smollm' (LLAMA_VOCAB_PRE_TYPE_SMOLLM).
SMOLLM_REGEXES = (
    r'\p{N}',
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)

SAMPLES = [
    'Hello, world!', 'The capital of France is Paris.', '  multiple   spaces\tand\ttabs\n\n',
    "I'm sure they'll say it's fine, we've done it, you'd agree", 'Hello world! 123 45678',
    'Café déjà vu — naïve façade', '日本語のテキストと中文字符', 'Emoji: 😀🤖🦾👩‍👩‍👧 ✨',
    'def f(x):\n    return x ** 2  # square\n', '{"key": [1, 2.5e-3, null, true]}',
    '<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n',
    'tabs\t\tand\r\nwindows newlines\r\n', ' leading space', 'trailing space ', '',
    'Ünïcödé ÀÉÎÕÜ ßẞ', 'Ελληνικά και Русский текст', 'x' * 300, '1234567890' * 5,
]


# llama.cpp's (std::regex-adapted) patterns for other pre-tokenizer families.
_LLAMA3_CPP = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r'|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+'
               r'|\s+(?!\S)|\s+')
PRE_REGEXES = {
    'smollm': SMOLLM_REGEXES,
    'gpt-2': SMOLLM_REGEXES[1:],
    'llama-bpe': (_LLAMA3_CPP,),
    'dbrx': (_LLAMA3_CPP,),
    'qwen2': (_LLAMA3_CPP.replace(r'\p{N}{1,3}', r'\p{N}'),),
    'default': (r'[\p{P}\$\+<=>\^~\|]+', SMOLLM_REGEXES[1], r'\p{N}+', '[0-9][0-9][0-9]'),
}


# --- llama.cpp reference -------------------------------------------------------------------

def _byte_to_unicode():
    keep = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
            + list(range(ord('®'), ord('ÿ') + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class LlamaCppBpe:
    """llama.cpp's byte-level BPE session (llm_tokenizer_bpe_session) in Python."""

    def __init__(self, tokens, types, merges, regexes):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(' ', 1)): r for r, m in enumerate(merges)}
        self.specials = sorted((t for t, k in zip(tokens, types) if k in (3, 4)),
                               key=len, reverse=True)
        self.regexes = [regex.compile(r) for r in regexes]
        self.b2u = _byte_to_unicode()

    def encode(self, text):
        out = []
        for piece, is_special in self._partition(text):
            if is_special:
                out.append(self.ids[piece])
            else:
                for word in self._split(piece):
                    out.extend(self._bpe(''.join(self.b2u[b] for b in word.encode('utf-8'))))
        return out

    def _partition(self, text):
        # tokenizer_st_partition: special tokens (longest first) cut the text into fragments.
        frags = [(text, False)]
        for sp in self.specials:
            nxt = []
            for frag, special in frags:
                if special:
                    nxt.append((frag, True))
                    continue
                parts = frag.split(sp)
                for i, part in enumerate(parts):
                    if i:
                        nxt.append((sp, True))
                    if part:
                        nxt.append((part, False))
            frags = nxt
        return frags

    def _split(self, text):
        pieces = [text]
        for rx in self.regexes:
            nxt = []
            for p in pieces:
                pos = 0
                for m in rx.finditer(p):
                    if m.start() > pos:
                        nxt.append(p[pos:m.start()])
                    if m.end() > m.start():
                        nxt.append(m.group())
                    pos = m.end()
                if pos < len(p):
                    nxt.append(p[pos:])
            pieces = nxt
        return pieces

    def _bpe(self, word):
        symbols = list(word)
        while len(symbols) > 1:
            best = None
            for i in range(len(symbols) - 1):
                rank = self.ranks.get((symbols[i], symbols[i + 1]))
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        # A byte missing from the vocabulary has no token: llama.cpp drops it.
        return [self.ids[s] for s in symbols if s in self.ids]


class LlamaCppSpm:
    """llama.cpp's SentencePiece session (llm_tokenizer_spm_session) in Python."""

    def __init__(self, tokens, scores, add_space_prefix=True):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.add_space_prefix = add_space_prefix

    def encode(self, text):
        if not text:
            return []
        if self.add_space_prefix:
            text = ' ' + text
        text = text.replace(' ', '▁')
        symbols = list(text)
        heap = []
        alive = [True] * len(symbols)
        nxt = list(range(1, len(symbols))) + [-1]
        prv = list(range(-1, len(symbols) - 1))

        def push(left, right):
            if left == -1 or right == -1:
                return
            merged = symbols[left] + symbols[right]
            tid = self.ids.get(merged)
            if tid is not None:
                # Highest score first; equal scores: leftmost first.
                heapq.heappush(heap, (-self.scores[tid], left, right, merged))

        for i in range(len(symbols) - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or symbols[left] + symbols[right] != merged \
                    or nxt[left] != right:
                continue
            symbols[left] = merged
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        out, i = [], 0 if symbols else -1
        while i != -1:
            tid = self.ids.get(symbols[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.ids[f'<0x{b:02X}>'] for b in symbols[i].encode('utf-8'))
            i = nxt[i]
        return out


# Characters assigned in Python's Unicode database (14.0). Code points assigned only by newer
# Unicode versions get different \p{L}/\p{N} classes in different regex engines (llama.cpp's
# tables, Oniguruma, the regex module); no text in a model's training data depends on them.
ASSIGNED = st.characters(blacklist_categories=('Cs', 'Cn'))


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp('smollm2_text')
    info = write_text_model_dir(out)
    reader = gguf.GGUFReader(smollm2_gguf())
    fields = {k: reader.fields[k].contents() for k in (
        'tokenizer.ggml.tokens', 'tokenizer.ggml.token_type', 'tokenizer.ggml.merges',
        'tokenizer.chat_template')}
    tok = Tokenizer.from_file(str(out / TOKENIZER_FILE))
    ref = LlamaCppBpe(fields['tokenizer.ggml.tokens'], fields['tokenizer.ggml.token_type'],
                      fields['tokenizer.ggml.merges'], SMOLLM_REGEXES)
    b2u = _byte_to_unicode()
    missing = {b for b in range(256) if b2u[b] not in tok.get_vocab()}
    return {'dir': out, 'info': info, 'tok': tok, 'ref': ref, 'fields': fields,
            'missing_bytes': missing}


def write_gguf(path, kv):
    """Write a metadata-only GGUF file (no tensors) with the given tokenizer keys."""
    writer = gguf.GGUFWriter(str(path), 'llama')
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key.endswith('scores'):
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


# --- SmolLM2 (byte-level BPE, pre 'smollm') -------------------------------------------------

def test_files_and_special_ids(smollm2):
    info, out, tokens = smollm2['info'], smollm2['dir'], smollm2['fields']['tokenizer.ggml.tokens']
    assert (out / TOKENIZER_FILE).is_file()
    assert (out / CHAT_TEMPLATE_FILE).read_text() == smollm2['fields']['tokenizer.chat_template']
    assert info['chat_template_source'] == 'gguf'
    assert tokens[info['bos_token_id']] == '<|im_start|>'
    assert tokens[info['eos_token_ids'][0]] == '<|im_end|>'
    assert tokens.index('<|endoftext|>') in info['eos_token_ids']
    assert info['add_bos_token'] is False
    assert info['vocab_size'] == len(tokens) == smollm2['tok'].get_vocab_size()
    json.loads((out / TOKENIZER_FILE).read_text())  # plain JSON others can load


def test_chat_prompt_uses_special_ids(smollm2):
    tok = smollm2['tok']
    ids = tok.encode('<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n').ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert ids[ids.index(2) + 1] == tok.token_to_id('Ċ')  # '\n' after <|im_end|>
    assert tok.decode(ids, skip_special_tokens=True) == 'user\nHi there\nassistant\n'


@pytest.mark.parametrize('text', SAMPLES)
def test_matches_llama_cpp_reference(smollm2, text):
    assert smollm2['tok'].encode(text).ids == smollm2['ref'].encode(text)


@pytest.mark.parametrize('text', SAMPLES)
def test_roundtrip(smollm2, text):
    tok = smollm2['tok']
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=ASSIGNED, max_size=60)
       | st.text(alphabet=" \n\t'0123456789abcXYZé😀.,!?_-<|>", max_size=60))
def test_random_text_matches_reference_and_roundtrips(smollm2, text):
    ids = smollm2['tok'].encode(text).ids
    assert ids == smollm2['ref'].encode(text)
    if not set(text.encode('utf-8')) & smollm2['missing_bytes']:
        assert smollm2['tok'].decode(ids, skip_special_tokens=False) == text


def test_bytes_outside_the_vocabulary_are_dropped_like_llama_cpp(smollm2):
    # SmolLM2's vocabulary lacks a few bytes (some C0 controls, UTF-8 lead bytes 0xF1/0xF2).
    assert smollm2['missing_bytes']
    text = 'a\U00040000b\x04c'
    assert smollm2['tok'].encode(text).ids == smollm2['ref'].encode(text)
    # A dropped byte still keeps its neighbours apart: '//' is a token, '/\x16/' is two '/'.
    assert smollm2['tok'].encode('/\x16/').ids == smollm2['ref'].encode('/\x16/') == [31, 31]


# --- other vocabularies and bad input (small synthetic GGUFs) -------------------------------

def _spm_vocab():
    pieces = ['▁', 'a', 'b', 'c', 'd', '▁a', 'ab', 'bc', 'cd', '▁ab', 'abc', '▁abc', 'bcd',
              'dd', '▁d', 'ca', '▁b', '▁c', 'é']
    tokens = ['<unk>', '<s>', '</s>'] + [f'<0x{b:02X}>' for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # Distinct scores: longer pieces first, so merges build up words.
    scores = [0.0] * (3 + 256) + [-(i * 0.37 % 7) - 0.01 * i for i in range(len(pieces))]
    return tokens, types, scores


@pytest.fixture(scope='module')
def spm(tmp_path_factory):
    tokens, types, scores = _spm_vocab()
    base = tmp_path_factory.mktemp('spm')
    reader = write_gguf(base / 'spm.gguf', {
        'tokenizer.ggml.model': 'llama', 'tokenizer.ggml.tokens': tokens,
        'tokenizer.ggml.token_type': types, 'tokenizer.ggml.scores': scores,
        'tokenizer.ggml.bos_token_id': 1, 'tokenizer.ggml.eos_token_id': 2,
        'tokenizer.ggml.unknown_token_id': 0})
    info = write_tokenizer_files(reader, base / 'out')
    return info, Tokenizer.from_file(str(base / 'out' / TOKENIZER_FILE)), \
        LlamaCppSpm(tokens, scores), base / 'out'


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='abcd é€\n', max_size=24))
def test_sentencepiece_matches_llama_cpp_reference(spm, text):
    info, tok, ref, _ = spm
    assert tok.encode(text, add_special_tokens=False).ids == ref.encode(text)
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_sentencepiece_defaults(spm):
    info, tok, _, out = spm
    assert info['tokenizer_model'] == 'llama'
    assert info['add_bos_token'] is True  # llama.cpp's default for SentencePiece vocabularies
    assert tok.encode('ab', add_special_tokens=True).ids[0] == info['bos_token_id'] == 1
    assert info['eos_token_ids'] == [2]
    # No template in this GGUF: the ChatML default is written (and logged).
    assert info['chat_template_source'] == 'default-chatml'
    assert (out / CHAT_TEMPLATE_FILE).read_text() == DEFAULT_CHATML_TEMPLATE


@pytest.fixture(scope='module')
def pre_tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp('pre')
    out = {}
    # Every byte symbol in the vocabulary, as in real byte-level BPE vocabularies: a missing
    # byte would be split off on its own (what llama.cpp's BPE does with it), not a regex split.
    symbols = sorted(set(_byte_to_unicode().values()) - {'a', 'b'})
    for pre in PRE_REGEXES:
        kv = _bpe_kv(**{'tokenizer.ggml.pre': pre})
        kv.update({'tokenizer.ggml.tokens': kv['tokenizer.ggml.tokens'] + symbols,
                   'tokenizer.ggml.token_type': [1] * (3 + len(symbols))})
        reader = write_gguf(base / f'{pre}.gguf', kv)
        write_tokenizer_files(reader, base / pre)
        out[pre] = Tokenizer.from_file(str(base / pre / TOKENIZER_FILE))
    return out


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ASSIGNED, max_size=40)
       | st.text(alphabet=" \n\r\t'sStTdDlLmM0123456789aé.,!?$+<=>^~|-_", max_size=40))
def test_pre_tokenizer_splits_match_llama_cpp(pre_tokenizers, text):
    b2u = _byte_to_unicode()
    for pre, regexes in PRE_REGEXES.items():
        ref = LlamaCppBpe([], [], [], regexes)._split(text)
        ref = [''.join(b2u[b] for b in piece.encode('utf-8')) for piece in ref]
        got = [piece for piece, _ in pre_tokenizers[pre].pre_tokenizer.pre_tokenize_str(text)]
        assert got == ref, pre


def _bpe_kv(**extra):
    kv = {'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.tokens': ['a', 'b', 'ab'],
          'tokenizer.ggml.token_type': [1, 1, 1], 'tokenizer.ggml.merges': ['a b'],
          'tokenizer.ggml.pre': 'qwen2'}
    kv.update(extra)
    return kv


def test_small_byte_level_vocab(tmp_path):
    info = write_tokenizer_files(write_gguf(tmp_path / 'x.gguf', _bpe_kv()), tmp_path / 'o')
    tok = Tokenizer.from_file(str(tmp_path / 'o' / TOKENIZER_FILE))
    assert tok.encode('abab').ids == [2, 2]
    assert info['bos_token_id'] is None and info['eos_token_ids'] == []


@pytest.mark.parametrize('kv, error, words', [
    (_bpe_kv(**{'tokenizer.ggml.model': 'ugm'}), UnsupportedModelError, 'ugm'),
    (_bpe_kv(**{'tokenizer.ggml.model': 'bert'}), ModelLoadError, 'unknown_token_id'),
    (_bpe_kv(**{'tokenizer.ggml.pre': 'no-such-pre'}), UnsupportedModelError, 'no-such-pre'),
    ({'general.name': 'x'}, ModelLoadError, 'tokenizer.ggml.model'),
    (_bpe_kv(**{'tokenizer.ggml.merges': ['ab']}), ModelLoadError, "'ab'"),
    (_bpe_kv(**{'tokenizer.ggml.bos_token_id': 7}), ModelLoadError, 'bos_token_id=7'),
    (_bpe_kv(**{'tokenizer.ggml.add_bos_token': True}), ModelLoadError, 'add_bos_token'),
])
def test_bad_metadata(tmp_path, kv, error, words):
    reader = write_gguf(tmp_path / 'bad.gguf', kv)
    with pytest.raises(error, match=words.replace('.', r'\.')):
        write_tokenizer_files(reader, tmp_path / 'out')
