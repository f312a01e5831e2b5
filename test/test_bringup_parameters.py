"""The parameter schema: self-consistent, and in step with the engine's config types."""
import dataclasses

import pytest

from edge_llm_ros.bringup import parameters
from edge_llm_ros.bringup.errors import ParameterRangeError, UnknownParameterError

LLM = parameters.schema('llm_node')
ALL_SPECS = [(node, spec) for node, schema in sorted(parameters.SCHEMAS.items())
             for spec in schema.specs]


@pytest.mark.parametrize('node', sorted(parameters.SCHEMAS))
def test_names_unique_and_dotted_lowercase(node):
    names = parameters.schema(node).names()
    assert len(names) == len(set(names))
    for name in names:
        assert name == name.lower() and ' ' not in name


@pytest.mark.parametrize('node, spec', ALL_SPECS, ids=[f'{n}:{s.name}' for n, s in ALL_SPECS])
def test_default_satisfies_its_own_spec(node, spec):
    assert spec.validate(spec.default) == spec.default
    assert spec.description


def test_vision_nodes_have_their_full_schema():
    # One schema per node: the vision nodes declare exactly these (nodes/node_params.py).
    assert {'frame_source', 'perception'} <= set(parameters.SCHEMAS)
    perception = parameters.schema('perception')
    assert {'input.topic', 'model.path', 'pool.id', 'engine.providers'} <= set(
        perception.names())
    assert perception.get('model.hidden_size').default == parameters.SMOLLM2_HIDDEN
    width = parameters.schema('frame_source').get('width')
    assert (width.range.low, width.range.high) == (parameters.MIN_FRAME_SIDE,
                                                   parameters.MAX_FRAME_SIDE)


def test_defaults_are_consistent():
    parameters.check_consistency(LLM.defaults())


def test_engine_kwargs_cover_engine_config():
    engine = pytest.importorskip('edge_llm_ros.serving.engine')
    from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
    fields = {f.name for f in dataclasses.fields(engine.EngineConfig)}
    kwargs = parameters.engine_kwargs(LLM.defaults())
    assert set(kwargs) | {'speculative'} == fields
    values = dict(LLM.defaults(), **{'speculative.mode': 'draft',
                                     'speculative.draft_model': '/models/draft'})
    speculative = SpeculativeConfig(**parameters.speculative_kwargs(values))
    speculative.check()
    assert (speculative.mode, speculative.max_draft) == ('draft', 6)
    engine.EngineConfig(**kwargs, speculative=speculative)


def test_sampling_kwargs_cover_sampling_config():
    from edge_llm_ros.runtime.types import SamplingConfig
    fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    values = dict(LLM.defaults(), **{'sampling.seed': 7})
    kwargs = parameters.sampling_kwargs(values)
    assert set(kwargs) == fields
    assert SamplingConfig(**kwargs).seed == 7
    assert parameters.sampling_kwargs(LLM.defaults())['seed'] is None


def test_engine_kwargs_resolve_threads_and_ort_affinity():
    values = dict(LLM.defaults(), **{
        'engine.cpu_affinity': '4-7', 'engine.intra_op_threads': 0,
        'engine.providers': ['CUDAExecutionProvider', 'CPUExecutionProvider'],
        'engine.provider_options': ['CUDAExecutionProvider:device_id=0',
                                    'CUDAExecutionProvider:gpu_mem_limit=1024']})
    kwargs = parameters.engine_kwargs(values)
    assert kwargs['intra_op_threads'] == 4          # one per pinned core
    assert kwargs['intra_op_affinity'] == '6;7;8'   # 1-based ids, decode thread keeps core 4
    assert kwargs['provider_options'] == ({'device_id': '0', 'gpu_mem_limit': '1024'}, {})


def test_read_only_split():
    runtime = {s.name for s in LLM.specs if not s.read_only}
    # update.drain_timeout_s is read when an update arrives (model_update.py).
    assert runtime == {n for n in LLM.names() if n.startswith(('sampling.', 'feedback.'))} | {
        'system_prompt', 'max_tokens', 'update.drain_timeout_s'}


def test_constraints_text_for_descriptors():
    assert LLM.get('sampling.top_p').constraints == 'range (0, 1]'
    assert 'one of: float32, int8' in LLM.get('kv.dtype').constraints


def test_unknown_name_suggests():
    with pytest.raises(UnknownParameterError, match='did you mean kv.max_context'):
        LLM.get('kv.max_ctx')
    with pytest.raises(UnknownParameterError, match='no parameter schema'):
        parameters.schema('camera')


def test_provider_options_parsing():
    assert parameters.parse_provider_options(
        ['CUDAExecutionProvider:device_id=0', 'CUDAExecutionProvider: x = y ']) == {
        'CUDAExecutionProvider': {'device_id': '0', 'x': 'y'}}
    for bad in ('device_id=0', 'CUDAExecutionProvider:device_id', 'Foo:a=b'):
        with pytest.raises(ValueError):
            parameters.parse_provider_options([bad])


def test_spec_bool_is_not_an_integer():
    with pytest.raises(Exception, match='expected integer'):
        LLM.get('max_tokens').validate(True)
    with pytest.raises(ParameterRangeError):
        LLM.get('sampling.seed').validate(-2)
