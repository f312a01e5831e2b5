"""Gemma 4 text (gemma4): tiny random GGUFs against llama.cpp, and the engine over them.

The fixture (gguf_fixtures.Gemma4Case) has what the family adds to gemma3: per-layer
embeddings, a sliding-window and a global layer with their own head sizes and KV heads, two
shared-KV layers (a sliding-window one and a global one, each reading the last layer of its
kind that keeps KV), proportional RoPE on the global layers, V normalized, layer output scales,
MLPs twice as wide on the shared layers, and a written soft cap.

Parity (test_llama_cpp_parity's machinery): 32/32 greedy ids equal to llama.cpp and every
logit within MAX_ABS_DIFF of its logits on its greedy path, with llama.cpp's top-2 margin
above twice the bound (so no argmax can flip within it). Measured: 0.34-0.60 over peak
logits of 82-84 (F16 at level 0; Q8_0, Q4_K through the op library). The kquant bound is
the general one here, not test_llama_cpp_parity's 0.4: four layers of random weights under
Gemma's post-norms grow llama.cpp's own rounding (2 layers: 0.34-0.40). Control: each
feature alone (per-layer embeddings, shared KV, proportional RoPE) moves llama.cpp's logits
beyond twice the bound, so a converter that ignored one would fail.

Engine: goals batched in one slot table equal each alone bit for bit; a prompt that extends
an earlier one reuses its prefix and equals the uncached run; a session continues bit for
bit. The shared layers keep no buffers: model.yaml lists them as 'shared' and the KV budget
counts the layers that keep KV once.
"""
import dataclasses
import pathlib

from gguf_fixtures import Gemma4Case, write_gemma4_gguf
from llama_cpp_parity import compare, llama_cpp_greedy
import numpy as np
import onnx
import pytest
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import UnsupportedModelError
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig, kv_budget_bytes

MAX_ABS_DIFF = 0.75
MIN_MARGIN = 2 * MAX_ABS_DIFF
CASE = Gemma4Case('Q8_0')
PARITY = [(Gemma4Case('F16'), 0, 'matmulnbits'), (Gemma4Case('Q8_0'), 4, 'kquant'),
          (Gemma4Case('Q4_K'), 4, 'kquant')]


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('gemma4')


def gguf_of(work: pathlib.Path, case: Gemma4Case) -> pathlib.Path:
    path = work / f'{case.tag}.gguf'
    if not path.is_file():
        write_gemma4_gguf(path, case)
    return path


def llama_logits(work: pathlib.Path, case: Gemma4Case) -> np.ndarray:
    path = gguf_of(work, case)
    return llama_cpp_greedy(path, work / f'{path.stem}.llama_cpp.npz')[0]


@pytest.fixture(scope='module')
def kquant_dir(work, native_library) -> pathlib.Path:
    return convert(str(gguf_of(work, CASE)), str(work / 'kquant'), progress=False)


@pytest.mark.parametrize('case, level, weights', PARITY, ids=lambda v: getattr(v, 'tag', v))
def test_greedy_ids_and_logits_match_llama_cpp(work, native_library, case, level, weights,
                                               compat):
    result = compare(gguf_of(work, case), work, accuracy_level=level, weights=weights)
    print(f'{case.tag} level {level} {weights}: {result.summary()}')
    top2 = np.sort(llama_logits(work, case), axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > MIN_MARGIN, 'fixture has a near-tie'
    assert result.greedy_equal, (result.llama_tokens, result.engine_tokens)
    assert result.max_abs_diff <= MAX_ABS_DIFF, result.summary()
    compat('gemma4', case.wtype, 'text')


@pytest.mark.parametrize('variant', [{'per_layer': 0}, {'shared': 0}, {'proportional': False}],
                         ids=str)
def test_each_feature_is_visible_to_the_harness(work, variant):
    """Control: one feature alone moves llama.cpp's logits beyond twice the bound."""
    moved = float(np.abs(llama_logits(work, CASE)
                         - llama_logits(work, dataclasses.replace(CASE, **variant))).max())
    print(f'{variant}: max |dlogit| {moved:.2f}')
    assert moved > 2 * MAX_ABS_DIFF


def test_the_folder_keeps_kv_once_and_gathers_the_per_layer_table(kquant_dir):
    meta = yaml.safe_load((kquant_dir / 'model.yaml').read_text())
    assert meta['layer_states'] == [
        {'kind': 'kv', 'window': 6, 'head_dim': 64, 'kv_heads': 2},
        {'kind': 'kv', 'window': 0},
        {'kind': 'shared', 'owner': 0}, {'kind': 'shared', 'owner': 1}]
    info = load_model_info(str(kquant_dir))
    assert info.kv_layers == (0, 1)
    assert info.kv_dims(0) == (2, 64) and info.kv_dims(1) == (1, 128)
    # K and V of the two layers that keep them, float32, per position and slot.
    assert kv_budget_bytes(info, 64, 2) == 2 * 64 * (2 * 2 * 64 + 2 * 1 * 128) * 4
    model = onnx.load(str(kquant_dir / 'model.onnx'), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    assert {'past_key_values.2.key', 'past_key_values.3.value'}.isdisjoint(inputs)
    nodes = {n.name: n for n in model.graph.node}
    # The per-layer table: rows gathered from its GGUF blocks (Q8_0), never multiplied whole.
    assert nodes['ple_embed'].op_type == 'KQuantGather'
    table = next(t for t in model.graph.initializer if t.name == 'ple_embed.gguf_blocks')
    vocab, width = info.vocab_size, CASE.per_layer * CASE.layers
    assert list(table.dims) == [vocab, width // 32 * 34]
    assert [n.input[3] for n in model.graph.node if n.op_type == 'CausalAttention'][2:] == [
        'present.0.key', 'present.1.key']


@pytest.mark.parametrize('change, match', [
    ({'moe': True}, 'mixture-of-experts'),
    ({'swa_rot': 32}, 'partial rotary'),
])
def test_what_the_converter_does_not_build_is_refused(tmp_path, change, match):
    import gguf
    path = write_gemma4_gguf(tmp_path / 'base.gguf', CASE)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / 'bad.gguf'), 'gemma4')
    for field in reader.fields.values():
        if field.name.startswith('GGUF.') or field.name == 'general.architecture':
            continue
        if change.get('swa_rot') and field.name == 'gemma4.rope.dimension_count_swa':
            writer.add_uint32(field.name, change['swa_rot'])
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        raw = None if t.tensor_type == gguf.GGMLQuantizationType.F32 else t.tensor_type
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=raw)
    if change.get('moe'):
        writer.add_tensor('blk.0.ffn_gate_inp.weight', np.zeros((4, CASE.hidden), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=match):
        convert(str(tmp_path / 'bad.gguf'), str(tmp_path / 'out'), progress=False)
    assert not (tmp_path / 'out').exists()


def test_float16_activations_are_refused_with_what_to_do(work, tmp_path):
    from edge_llm_ros.errors import ConversionError
    with pytest.raises(ConversionError, match='attention layers run in float32'):
        convert(str(gguf_of(work, CASE)), str(tmp_path / 'out'), progress=False,
                activation_dtype='float16')


# --- engine ------------------------------------------------------------------------------------
TEXTS = ('once upon a time there was a robot', 'the blue sky is blue', 'Hello robot arm')


def engine(model_dir: pathlib.Path, n: int = 1, **kw) -> Engine:
    kw.setdefault('max_context', 96)
    return Engine(EngineConfig(model_dir=str(model_dir), intra_op_threads=1,
                               parallel_sequences=n, **kw))


def run_text(eng: Engine, text: str, max_tokens: int = 12):
    return eng.generate(GenerationRequest(
        prompt=text, max_tokens=max_tokens, use_chat_template=False,
        sampling=SamplingConfig(temperature=0.0, logprobs=True))).run_to_end()


def bits(result) -> tuple:
    return result.token_ids, [lp.logprob for lp in result.logprobs]


@pytest.fixture(scope='module')
def alone(kquant_dir) -> dict:
    """Give each text's tokens and logprobs when it runs by itself, nothing cached."""
    eng = engine(kquant_dir, prefix_reuse=False)
    try:
        return {text: bits(run_text(eng, text)) for text in TEXTS}
    finally:
        eng.close()


def test_batched_goals_equal_each_alone_bit_for_bit(kquant_dir, alone, compat):
    from edge_llm_ros.serving.goal import Goal
    eng = engine(kquant_dir, 3, prefill_chunk=3, prefix_reuse=False)
    try:
        goals = []
        for text in TEXTS:
            request = GenerationRequest(prompt=text, max_tokens=12, use_chat_template=False,
                                        sampling=SamplingConfig(temperature=0.0,
                                                                logprobs=True))
            goals.append(eng.scheduler().submit(Goal(eng.prepare(request))))
        while not all(g.done for g in goals):
            eng.run_plan()
    finally:
        eng.close()
    for g, text in zip(goals, TEXTS):
        assert bits(g.result) == alone[text], text
    compat('gemma4', CASE.wtype, 'batching')


def test_prefix_reuse_equals_the_uncached_run(kquant_dir, alone):
    eng = engine(kquant_dir, prefix_reuse=True)
    try:
        run_text(eng, TEXTS[0] + ' ' + TEXTS[1])
        result = run_text(eng, TEXTS[0])
    finally:
        eng.close()
    assert result.timings.cached_prompt_tokens > 0
    assert bits(result) == alone[TEXTS[0]]


def test_a_session_continues_bit_for_bit(kquant_dir, compat):
    user1 = ChatMessage('user', TEXTS[0])
    user2 = ChatMessage('user', 'What color is the sky?')

    def turn(eng, messages, session=''):
        return eng.generate(GenerationRequest(
            messages=list(messages), session_id=session, max_tokens=8,
            sampling=SamplingConfig(temperature=0.0, logprobs=True))).run_to_end()

    plain = engine(kquant_dir, max_context=256, prefix_reuse=False)
    try:
        first = turn(plain, [user1])
        second = turn(plain, [user1, ChatMessage('assistant', first.text), user2])
    finally:
        plain.close()
    eng = engine(kquant_dir, max_context=256)
    try:
        a1 = turn(eng, [user1], 'a')
        turn(eng, [user2], 'b')   # takes the only slot: a's turn is saved as a snapshot
        a2 = turn(eng, [user1, ChatMessage('assistant', a1.text), user2], 'a')
    finally:
        eng.close()
    assert bits(a1) == bits(first)
    assert bits(a2) == bits(second)
    assert a2.timings.cached_prompt_tokens > 0
    compat('gemma4', CASE.wtype, 'sessions')


# --- family: template switch, tool format ------------------------------------------------------
def test_the_family_config_names_the_model_and_switches_reasoning_on_explicitly(kquant_dir):
    from edge_llm_ros.runtime import model_config as mc
    family = mc.family_for_model_dir(kquant_dir)
    assert family.family == 'gemma4' and family.tool_call_format == 'gemma4'
    # Gemma 4's template reasons only when enable_thinking is passed True.
    assert family.template_kwargs(reasoning=True) == {'enable_thinking': True}
    assert family.template_kwargs(reasoning=False) == {'enable_thinking': False}
    assert family.can_disable_reasoning
    assert mc.family_for_model({'gguf_name': 'Gemma-4-E2B-It', 'architecture': 'gemma4'}).family \
        == 'gemma4'


def test_native_tool_calls_are_read_streamed_or_whole():
    from edge_llm_ros.runtime.tools.formats import tool_format
    from edge_llm_ros.runtime.tools.parser import parse_all, ToolCallParser
    from edge_llm_ros.runtime.tools.spec import ToolSpec
    tools = [ToolSpec('move_to', '', {'type': 'object', 'required': ['x'], 'properties': {
        'x': {'type': 'number'}, 'frame': {'type': 'string'}, 'opts': {'type': 'object'}}}),
        ToolSpec('stop')]
    fmt = tool_format('gemma4')
    q = '<|"|>'
    text = (f'Sure.<|tool_call>call:move_to{{frame:{q}map, base{q},opts:{{fast:true,'
            f'list:[1,2.5,{q}a{q}]}},x:1.5}}<tool_call|><|tool_call>call:stop{{}}<tool_call|>')
    answer, calls, invalid = parse_all(text, fmt, tools)
    assert answer == 'Sure.' and not invalid
    assert [(c.name, c.arguments) for c in calls] == [
        ('move_to', '{"frame": "map, base", "opts": {"fast": true, "list": [1, 2.5, "a"]}, '
                    '"x": 1.5}'), ('stop', '{}')]
    parser = ToolCallParser(fmt, tools)
    streamed = ''.join(parser.feed(c).text for c in text) + parser.finish().text
    assert streamed == 'Sure.' and [c.arguments for c in parser.calls] == [
        c.arguments for c in calls]
    # What the tool constraint forces (JSON between the markers) is read too.
    assert parse_all('<|tool_call>{"name": "stop", "arguments": {}}<tool_call|>', fmt,
                     tools)[1][0].name == 'stop'
    _, calls, invalid = parse_all(f'<|tool_call>call:move_to{{x:{q}oops}}<tool_call|>', fmt,
                                  tools)
    assert not calls and 'Gemma 4 call syntax' in invalid[0].error


# --- tokenizer ---------------------------------------------------------------------------------
TOKENIZER_TEXTS = ['the robot arm', ' the  arm\n\nthe', 'é tét\n\n\nrobots in', 'xyz€ q',
                   '<|turn>user\nthe robot<turn|>\n<|tool_call>call:arm{}<tool_call|>']
_PEER_TOKENIZE = """
import json, sys
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
texts = json.loads(sys.argv[2])
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]))
"""


def test_a_gemma4_vocabulary_tokenizes_as_llama_cpp_does(work):
    """Tokenizer model 'gemma4' (llama.cpp's SentencePiece-style BPE over merges)."""
    import json
    import subprocess
    from llama_cpp_parity import peer_python
    from tokenizers import Tokenizer
    path = write_gemma4_gguf(work / 'gemma4-vocab.gguf', CASE, gemma4_tokenizer=True)
    out = convert(str(path), str(work / 'gemma4-vocab'), progress=False)
    proc = subprocess.run([peer_python(), '-c', _PEER_TOKENIZE, str(path),
                           json.dumps(TOKENIZER_TEXTS)], capture_output=True, text=True,
                          timeout=300, check=True)
    want = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = Tokenizer.from_file(str(out / 'tokenizer.json'))
    got = [tok.encode(t, add_special_tokens=False).ids for t in TOKENIZER_TEXTS]
    assert got == want
    for text, ids in zip(TOKENIZER_TEXTS[:3], got):
        assert tok.decode(ids) == text
    info = load_model_info(str(out))
    assert info.bos_token_id == 2 and info.add_bos_token


# --- HF folders ----------------------------------------------------------------------------------
@pytest.mark.parametrize('multimodal', [False, True], ids=['causal_lm', 'conditional_generation'])
def test_an_hf_folder_converts_to_the_model_of_its_gguf(work, native_library, multimodal):
    """The same float32 weights as a GGUF and as an HF folder give the same graph and logits."""
    from gguf_fixtures import write_gemma4_hf
    from llama_cpp_parity import engine_logits, PROMPT
    case = Gemma4Case('F32')
    gguf_dir = convert(str(gguf_of(work, case)), str(work / 'f32-gguf'), progress=False,
                       overwrite=True)
    hf = write_gemma4_hf(work / f'hf-{multimodal}', case, multimodal=multimodal)
    hf_dir = convert(str(hf), str(work / f'f32-hf-{multimodal}'), progress=False)
    for name in ('model.onnx', 'model.onnx.data'):
        assert (hf_dir / name).read_bytes() == (gguf_dir / name).read_bytes(), name
    follow = [7, 8, 9]
    np.testing.assert_array_equal(engine_logits(hf_dir, PROMPT, follow),
                                  engine_logits(gguf_dir, PROMPT, follow))
    assert yaml.safe_load((hf_dir / 'model.yaml').read_text())['layer_states'] == \
        yaml.safe_load((gguf_dir / 'model.yaml').read_text())['layer_states']


# --- speculation -------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def draft_dir(work, native_library) -> pathlib.Path:
    """Give another gemma4 of the same vocabulary (other weights): a draft it often rejects."""
    case = dataclasses.replace(CASE, seed=7, chain=0.3)
    return convert(str(gguf_of(work, case)), str(work / 'draft'), progress=False)


def test_speculation_equals_plain_decoding(kquant_dir, draft_dir, compat):
    """Verify passes over shared-KV layers give a decode step's bits (greedy and seeded)."""
    from edge_llm_ros.runtime.speculative import SpeculativeConfig
    from edge_llm_ros.serving.goal import Goal
    texts = [' '.join([t] * 4) for t in TEXTS[:2]]   # repetitive: prompt lookup drafts
    seeded = SamplingConfig(temperature=0.8, top_k=20, seed=3, logprobs=True)
    modes = {'off': SpeculativeConfig(mode='off'),
             'prompt_lookup': SpeculativeConfig(mode='prompt_lookup'),
             'draft': SpeculativeConfig(mode='draft', draft_model=str(draft_dir))}
    for sampling in (SamplingConfig(temperature=0.0, logprobs=True), seeded):
        runs = {}
        for mode, config in modes.items():
            eng = engine(kquant_dir, 2, max_context=256, speculative=config)
            try:
                goals = [eng.scheduler().submit(Goal(eng.prepare(GenerationRequest(
                    prompt=t, max_tokens=24, use_chat_template=False, sampling=sampling))))
                    for t in texts]
                while not all(g.done for g in goals):
                    eng.run_plan()
                runs[mode] = ([bits(g.result) for g in goals], eng.speculation.stats)
            finally:
                eng.close()
        plain, _ = runs.pop('off')
        for mode, (spec, stats) in runs.items():
            assert spec == plain, mode
            assert stats.passes > 0 and stats.accepted > 0, (mode, stats)
    compat('gemma4', CASE.wtype, 'speculation')
