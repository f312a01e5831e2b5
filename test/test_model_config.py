"""config/models: every shipped family loads; bad files fail with the file and key named."""
import pathlib

import pytest

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime import model_config as mc
from edge_llm_ros.runtime.model_config import ModelConfigError

FAMILIES = ('deepseek_r1_distill_llama', 'deepseek_r1_distill_qwen', 'gemma3', 'gemma4',
            'granite4', 'lfm2', 'llama3', 'mistral', 'phi3', 'qwen2', 'qwen3', 'qwen35',
            'smollm2', 'smollm3')
GOOD = """family: {name}
architectures: [llama]
stop_tokens: ['</s>']
tool_call_format: hermes
recommended: {{board: x86_64, context: 2048}}
conversion: {{precision: source}}
"""


def write(folder: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = folder / f'{name}.yaml'
    path.write_text(text)
    return path


def test_every_shipped_family_loads():
    configs = mc.load_all()
    assert tuple(sorted(configs)) == FAMILIES
    for name, cfg in configs.items():
        assert cfg.family == name
        assert cfg.architectures and set(cfg.architectures) <= set(mc.ARCHITECTURES)
        assert cfg.stop_tokens
        assert cfg.tool_call_format in mc.TOOL_CALL_FORMATS
    # Every architecture the converter knows has a family that answers for it.
    fallbacks = {a for c in configs.values() if c.fallback for a in c.architectures}
    assert fallbacks == set(mc.ARCHITECTURES)


def test_reasoning_families():
    qwen3 = mc.load_family('qwen3')
    assert qwen3.can_disable_reasoning
    assert qwen3.template_kwargs(reasoning=False) == {'enable_thinking': False}
    assert qwen3.template_kwargs(reasoning=True) == {}
    r1 = mc.load_family('deepseek_r1_distill_qwen')
    assert r1.reasoning.starts_open and not r1.can_disable_reasoning
    with pytest.raises(InvalidRequestError, match='cannot turn reasoning off.*reasoning_budget'):
        r1.template_kwargs(reasoning=False)
    assert mc.load_family('smollm2').template_kwargs(reasoning=False) == {}


@pytest.mark.parametrize('meta, family', [
    ({'name': 'Smollm2 135M 8k Lc100K Mix1 Ep2', 'architecture': 'llama'}, 'smollm2'),
    ({'name': 'DeepSeek R1 Distill Qwen 7B', 'architecture': 'qwen2'},
     'deepseek_r1_distill_qwen'),
    ({'name': 'DeepSeek-R1-Distill-Llama-8B', 'architecture': 'llama'},
     'deepseek_r1_distill_llama'),
    ({'name': 'Llama 3.2 1B Instruct', 'architecture': 'llama'}, 'llama3'),
    ({'name': 'Mistral 7B Instruct v0.3', 'architecture': 'llama'}, 'mistral'),
    ({'name': 'Qwen2.5 0.5B Instruct', 'architecture': 'qwen2'}, 'qwen2'),
    ({'name': 'Qwen3 0.6B', 'architecture': 'qwen3'}, 'qwen3'),
    ({'name': 'gemma-3-1b-it', 'architecture': 'gemma3'}, 'gemma3'),
    ({'name': 'Phi 4 Mini Instruct', 'architecture': 'phi3'}, 'phi3'),
    ({'name': 'some finetune', 'architecture': 'qwen2'}, 'qwen2'),        # fallback
    ({'name': 'Qwen3 0.6B', 'architecture': 'llama'}, 'llama3'),          # name needs its arch
    ({'name': 'whatever', 'architecture': 'llama', 'family': 'mistral'}, 'mistral'),
])
def test_family_for_model(meta, family):
    assert mc.family_for_model(meta).family == family


def test_family_lookup_errors():
    with pytest.raises(ModelConfigError, match="names family 'nope'.*known families: "
                                               'deepseek_r1_distill_llama'):
        mc.family_for_model({'family': 'nope'})
    with pytest.raises(ModelConfigError, match="no model family matches.*'mamba'.*family:"):
        mc.family_for_model({'name': 'x', 'architecture': 'mamba'})
    with pytest.raises(ModelConfigError, match="unknown model family 'llama4'; known"):
        mc.load_family('llama4')


def test_resolve_model_takes_name_file_or_folder(tmp_path):
    assert mc.resolve_model('qwen3').family == 'qwen3'
    assert mc.resolve_model(str(mc.models_dir() / 'gemma3.yaml')).family == 'gemma3'
    (tmp_path / 'model.yaml').write_text('name: SmolLM2 360M\narchitecture: llama\n')
    assert mc.resolve_model(str(tmp_path)).family == 'smollm2'
    with pytest.raises(ModelConfigError, match='model.yaml does not exist'):
        mc.family_for_model_dir(tmp_path / 'missing')


def test_the_runtime_leaves_the_recommended_board_to_bringup(tmp_path):
    # Boards are bringup's: launch checks the name (test_bringup_launch), the runtime keeps it.
    path = write(tmp_path, 'x', GOOD.format(name='x').replace('board: x86_64', 'board: pdp11'))
    assert mc.parse_family_file(path).recommended_board == 'pdp11'


def test_minimal_file_gets_defaults(tmp_path):
    cfg = mc.parse_family_file(write(tmp_path, 'x', GOOD.format(name='x')))
    assert cfg.reasoning is None and cfg.chat_template is None and not cfg.fallback
    assert cfg.conversion == {'precision': 'source'} and cfg.recommended_context == 2048
    assert cfg.template_path() is None
    assert cfg.grounding == ''   # no grounding unless the family says so


def test_grounding_families():
    """Qwen2.5-VL's JSON boxes are in the pixels it saw (vision/grounding.py's frames)."""
    configs = mc.load_all()
    assert {n: c.grounding for n, c in configs.items() if c.grounding} == {'qwen2': 'absolute'}


@pytest.mark.parametrize('edit, words', [
    (lambda t: t + 'stop_token: [x]\n', "unknown key 'stop_token'; valid keys: architectures"),
    (lambda t: t + 'reasoning: {opentag: a}\n', "unknown key 'reasoning.opentag'"),
    (lambda t: t + 'reasoning: {open_tag: a, close_tag: a}\n', 'two different'),
    (lambda t: t + 'reasoning: {force_close_text: x}\n', 'must contain close_tag'),
    (lambda t: t + 'reasoning: [a]\n', 'reasoning must be a mapping'),
    (lambda t: t.replace('[llama]', '[mamba]'), "architectures: 'mamba' is not one of"),
    (lambda t: t.replace('[llama]', '[]'), 'architectures must be a list .* at least one'),
    (lambda t: t.replace('hermes', 'xml'), "tool_call_format: 'xml' is not one of hermes"),
    (lambda t: t + 'grounding: pixels\n', "grounding: 'pixels' is not one of absolute, "
     'normalized_1000'),
    (lambda t: t.replace('context: 2048', 'context: true'), 'context must be int, not bool'),
    (lambda t: t.replace('context: 2048', 'context: 0'), 'context must be >= 1'),
    (lambda t: t.replace('precision: source', 'precision: int2'), 'conversion.precision'),
    (lambda t: t.replace('precision: source', 'bits: 4'), "unknown key 'conversion.bits'"),
    (lambda t: t + 'chat_template: missing.jinja\n', 'missing.jinja does not exist'),
    (lambda t: t.replace('family: bad', 'family: other'), "must equal the file name 'bad'"),
    (lambda t: t.replace('family: bad', ''), 'family is required'),
    (lambda t: t + 'fallback: yes please\n', 'fallback must be bool'),
    (lambda t: t + 'stop_tokens: [""]\n', 'stop_tokens must be a list of non-empty strings'),
    (lambda t: t + 'a: [\n', 'is not valid YAML'),
    (lambda t: '- just\n- a list\n', 'must be a mapping'),
    (lambda t: 'a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n'
     'c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\n'
     'e: &e [*d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e]\n',
     'expands to more than'),
])
def test_bad_files_name_file_and_key(tmp_path, edit, words):
    path = write(tmp_path, 'bad', edit(GOOD.format(name='bad')))
    with pytest.raises(ModelConfigError, match=words) as info:
        mc.parse_family_file(path)
    assert str(path) in str(info.value)


def test_template_override_is_found(tmp_path):
    (tmp_path / 'templates').mkdir()
    (tmp_path / 'templates' / 't.jinja').write_text('{{ messages }}')
    cfg = mc.parse_family_file(write(tmp_path, 'x', GOOD.format(name='x')
                                     + 'chat_template: t.jinja\n'))
    assert cfg.template_path().read_text() == '{{ messages }}'


def test_two_fallbacks_for_one_architecture_are_refused(tmp_path):
    for name in ('a', 'b'):
        write(tmp_path, name, GOOD.format(name=name) + 'fallback: true\n')
    with pytest.raises(ModelConfigError, match='both a and b claim architecture llama'):
        mc.load_all(tmp_path)
    with pytest.raises(ModelConfigError, match='claim architecture'):
        mc.family_for_model({'architecture': 'llama'}, tmp_path)


def test_unreadable_file(tmp_path):
    with pytest.raises(ModelConfigError, match='cannot be read'):
        mc.parse_family_file(tmp_path / 'none.yaml')
