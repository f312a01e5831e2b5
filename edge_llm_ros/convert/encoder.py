"""Write an embedding / reranking model folder from an encoder GGUF.

A BERT-style GGUF (`bert`, `nomic-bert`, `jina-bert-v2`, `modern-bert`: encoder_graph.py), a
decoder family's GGUF that names a pooling type (Qwen3-Embedding, Qwen3-Reranker) or
EmbeddingGemma (`gemma-embedding`): those are decoder_encoder_graph.py's. The folder holds
model.onnx (+ model.onnx.data), tokenizer.json and a model.yaml whose `kind: embedding` (or
`rerank` for a cross-encoder or a yes/no reranker) tells the runtime it is no chat model, and
whose `embedding` section says how the states become a vector (runtime/encoder.py). A reranker
whose GGUF has a rerank prompt (tokenizer.chat_template.rerank, with {query} and {document})
keeps it there as `rerank_template`: its pairs are that prompt, as llama-server builds them.
"""
import pathlib
from typing import Callable, Optional, Sequence, Tuple

from edge_llm_ros.convert.checkpoint import gguf_field, open_gguf
from edge_llm_ros.convert.decoder_encoder_graph import build_decoder_encoder
from edge_llm_ros.convert.encoder_graph import (build_encoder, DECODER_EMBEDDERS,
                                                EMBEDDING_ONLY, ENCODER_ARCHITECTURES,
                                                EncoderGguf, EncoderSource)
from edge_llm_ros.convert.encoder_hf import probe_hf_encoder, read_hf_encoder
from edge_llm_ros.convert.encoder_hf_decoder import hf_decoder_encoder_arch, HfDecoderEncoder
from edge_llm_ros.errors import UnsupportedModelError
from edge_llm_ros.model_format import CONVERTER_VERSION, DATA_FILE, MODEL_FILE, MODEL_YAML

KIND_EMBEDDING = 'embedding'
KIND_RERANK = 'rerank'
# HF folder readers of embedding / rerank models: (probe, reader) pairs. probe(folder) returns
# the architecture (llama.cpp's name) when the reader takes that folder, else None; reader(folder)
# returns an EncoderSource the graph builders take as they take an EncoderGguf.
ENCODER_FOLDER_READERS: Sequence[Tuple[Callable[[pathlib.Path], Optional[str]],
                                       Callable[[pathlib.Path], EncoderSource]]] = (
    (probe_hf_encoder, read_hf_encoder),  # BERT-style HF folders (encoder_hf.py)
    (hf_decoder_encoder_arch, HfDecoderEncoder),
)


def encoder_architecture(source: str) -> Optional[str]:
    """Return the source's architecture when it is an encoder this converter builds, else None.

    A GGUF file is read here; an HF folder by the readers in ENCODER_FOLDER_READERS.
    """
    path = pathlib.Path(source)
    if path.is_dir():
        return next((arch for arch in (probe(path) for probe, _ in ENCODER_FOLDER_READERS)
                     if arch), None)
    if not path.is_file() or path.suffix.lower() != '.gguf':
        return None
    reader = open_gguf(path)
    arch = gguf_field(reader, 'general.architecture')
    if arch in DECODER_EMBEDDERS and arch not in EMBEDDING_ONLY:  # chat unless it pools
        return arch if int(gguf_field(reader, f'{arch}.pooling_type', default=0)) else None
    return arch if arch in ENCODER_ARCHITECTURES else None


def open_encoder(source: pathlib.Path) -> EncoderSource:
    """Open an encoder GGUF or HF folder (encoder_architecture named it) for the graph builders."""
    if source.is_dir():
        for probe, reader in ENCODER_FOLDER_READERS:
            if probe(source):
                return reader(source)
        raise UnsupportedModelError(f'{source}: no embedding or rerank model this converter '
                                    'reads from an HF folder')
    return EncoderGguf(source)


def write_encoder_folder(source: pathlib.Path, tmp: pathlib.Path, sha256: str) -> None:
    """Write the encoder's graph, tokenizer and model.yaml into the (empty) folder tmp."""
    import onnx
    import yaml
    m = open_encoder(source)
    s = m.spec
    embedding = {'pooling': s.pooling, 'normalize': s.pooling != 'rank',
                 'dimensions': s.hidden, 'labels': s.labels}
    template = m.rerank_template()
    if s.pooling == 'rank' and template:
        embedding['rerank_template'] = template
    elif s.pooling == 'rank' and s.arch in DECODER_EMBEDDERS:
        raise UnsupportedModelError(f'{source}: a {s.arch} reranker without a rerank prompt '
                                    '(tokenizer.chat_template.rerank); convert it again with '
                                    "llama.cpp's convert_hf_to_gguf.py, which writes it")
    specials = m.write_tokenizer(tmp)
    (tmp / 'chat_template.jinja').unlink(missing_ok=True)  # not a chat model
    with open(tmp / DATA_FILE, 'wb') as data:
        model = (build_decoder_encoder if s.arch in DECODER_EMBEDDERS else build_encoder)(m, data)
    onnx.save_model(model, str(tmp / MODEL_FILE))
    types = sorted({t.qtype for t in m.tensors.values() if len(t.shape) == 2})
    name = m.display_name()
    meta = {
        'name': name, 'gguf_name': name, 'architecture': s.arch,
        'kind': KIND_RERANK if s.pooling == 'rank' else KIND_EMBEDDING,
        'num_layers': s.layers, 'num_heads': s.heads, 'hidden_size': s.hidden,
        'vocab_size': s.vocab_size, 'max_position_embeddings': s.context,
        'bos_token_id': specials.get('bos_token_id'),
        'eos_token_ids': list(specials.get('eos_token_ids', [])),
        'pad_token_id': specials.get('pad_token_id'),
        'embedding': embedding,
        'quantization': {'source_types': types},
        'op_domains': sorted({n.domain for n in model.graph.node if n.domain}),
        'source': {'path': str(source), 'sha256': sha256},
        'converter_version': CONVERTER_VERSION,
    }
    (tmp / MODEL_YAML).write_text(yaml.safe_dump(meta, sort_keys=False))
