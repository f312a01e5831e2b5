"""Signed model updates (edge_llm_ros.update): manifests, signatures, deltas, installs.

Real tiny model folders, real ed25519 keys and bsdiff4 patches; every refusal is checked for
its type and for a message that says what is wrong.
"""
import base64
import hashlib
import json
import os
import pathlib
import shutil

from cryptography.hazmat.primitives import serialization
import pytest
from update_support import keys, two_versions

from edge_llm_ros.model_format import CONVERTER_VERSION
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.update import canonical, cli, delta, manifest, signing
from edge_llm_ros.update.errors import (BadSignatureError, DeltaError, ExtraFileError,
                                        HashMismatchError, KeyFormatError, ManifestError,
                                        MissingFileError, SignatureError, UnknownFieldError,
                                        WrongKeyError)
from edge_llm_ros.update.install import ModelsRoot


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """Keys, signed v1/v2 folders and a v1 -> v2 delta package (made once)."""
    root = tmp_path_factory.mktemp('update')
    private, public = keys(root / 'keys')
    other_private, other_public = keys(root / 'keys', 'other')
    v1, v2 = two_versions(root, private)
    package = root / 'delta'
    delta.make_delta(v1, v2, package, signing.load_private(private))
    return {'root': root, 'private': private, 'public': public, 'other_private': other_private,
            'other_public': other_public, 'v1': v1, 'v2': v2, 'delta': package,
            'trusted': signing.load_public(str(public))}


def _copy(world, name, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(world[name], tmp_path / name))


def _resign_manifest(folder: pathlib.Path, obj: dict, private: pathlib.Path) -> None:
    data = canonical.dumps(obj)
    (folder / 'manifest.json').write_bytes(data)
    (folder / 'manifest.sig').write_bytes(signing.sign(data, signing.load_private(private)))


def test_signed_folder_verifies_and_lists_every_file(world):
    found = manifest.verify_folder(world['v1'], world['trusted'])
    names = {p.name for p in world['v1'].iterdir()} - {'manifest.json', 'manifest.sig'}
    assert set(found.files) == names and 'model.onnx.data' in names
    assert found.model_name == 'tiny-v1'
    assert found.converter_version == CONVERTER_VERSION
    data = (world['v1'] / 'model.onnx.data').read_bytes()
    assert found.files['model.onnx.data'].sha256 == hashlib.sha256(data).hexdigest()
    assert (world['v1'] / 'manifest.json').read_bytes() == found.to_bytes()


def test_tampered_file_is_refused(world, tmp_path):
    folder = _copy(world, 'v1', tmp_path)
    with open(folder / 'model.onnx.data', 'r+b') as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(HashMismatchError, match='model.onnx.data does not have the sha256 of '
                                                'the signed manifest: it was tampered with'):
        manifest.verify_folder(folder, world['trusted'])
    (folder / 'tokenizer.json').write_text('{}')
    with pytest.raises(HashMismatchError, match='tokenizer.json has 2 bytes, the signed '
                                                'manifest says'):
        manifest.verify_folder(folder, world['trusted'])


def test_wrong_key_is_refused(world):
    other = signing.load_public(str(world['other_public']))
    with pytest.raises(WrongKeyError, match=f'signed by key {signing.key_id(world["trusted"])}'
                                            f', but the trusted public key is '
                                            f'{signing.key_id(other)}'):
        manifest.verify_folder(world['v1'], other)


def test_signature_over_other_bytes_is_refused(world, tmp_path):
    folder = _copy(world, 'v1', tmp_path)
    # A genuine signature by the trusted key, but of v2's manifest.
    shutil.copyfile(world['v2'] / 'manifest.sig', folder / 'manifest.sig')
    with pytest.raises(BadSignatureError, match='manifest.sig does not match the bytes of .*'
                                                'signature was made over other bytes'):
        manifest.verify_folder(folder, world['trusted'])
    # The manifest edited after signing (a file hash swapped for the tampered file's).
    folder = _copy(world, 'v2', tmp_path / 'b')
    obj = json.loads((folder / 'manifest.json').read_bytes())
    obj['files']['model.yaml']['size'] += 1
    (folder / 'manifest.json').write_bytes(canonical.dumps(obj))
    with pytest.raises(BadSignatureError, match='was changed after it was signed'):
        manifest.verify_folder(folder, world['trusted'])


def test_manifest_with_unknown_field_is_refused_even_when_signed(world, tmp_path):
    folder = _copy(world, 'v1', tmp_path)
    obj = json.loads((folder / 'manifest.json').read_bytes())
    obj['post_install'] = 'rm -rf /'
    _resign_manifest(folder, obj, world['private'])
    with pytest.raises(UnknownFieldError, match=r'manifest.json has unknown field\(s\) '
                                                r'post_install \(this version knows '):
        manifest.verify_folder(folder, world['trusted'])
    obj.pop('post_install')
    obj['files']['model.onnx']['mode'] = 420
    _resign_manifest(folder, obj, world['private'])
    with pytest.raises(UnknownFieldError, match=r"files\['model.onnx'\] has unknown field"):
        manifest.verify_folder(folder, world['trusted'])


@pytest.mark.parametrize('change, message', [
    (lambda obj: obj.update(format_version=2), 'format_version 2 is not 1'),
    (lambda obj: obj.update(format_version=1.0), 'integer'),
    (lambda obj: obj['files'].pop('model.onnx'), 'does not list model.onnx'),
    (lambda obj: obj['files'].update({'../evil': obj['files']['model.yaml']}),
     "'../evil' is not an allowed file name"),
    (lambda obj: obj['files']['model.yaml'].update(sha256='ABC'), '64-hex lowercase'),
    (lambda obj: obj.pop('converter_version'), r'lacks field\(s\) converter_version'),
])
def test_manifest_schema_is_strict(world, tmp_path, change, message):
    obj = json.loads((world['v1'] / 'manifest.json').read_bytes())
    change(obj)
    folder = tmp_path / 'm'
    folder.mkdir()
    data = json.dumps(obj, sort_keys=True, separators=(',', ':')).encode()
    (folder / 'manifest.json').write_bytes(data)
    (folder / 'manifest.sig').write_bytes(signing.sign(data,
                                                       signing.load_private(world['private'])))
    with pytest.raises(ManifestError, match=message):
        manifest.verified_manifest(folder, world['trusted'])


def test_reformatted_manifest_is_refused(world, tmp_path):
    folder = _copy(world, 'v1', tmp_path)
    pretty = json.dumps(json.loads((folder / 'manifest.json').read_bytes()), indent=2).encode()
    (folder / 'manifest.json').write_bytes(pretty)
    (folder / 'manifest.sig').write_bytes(signing.sign(pretty,
                                                       signing.load_private(world['private'])))
    with pytest.raises(ManifestError, match='not in canonical form'):
        manifest.verify_folder(folder, world['trusted'])


def test_missing_extra_and_symlinked_files_are_refused(world, tmp_path):
    folder = _copy(world, 'v1', tmp_path)
    (folder / 'tokenizer.json').unlink()
    with pytest.raises(MissingFileError, match='lacks tokenizer.json listed in manifest.json'):
        manifest.verify_folder(folder, world['trusted'])
    folder = _copy(world, 'v1', tmp_path / 'b')
    (folder / 'notes.txt').write_text('x')
    with pytest.raises(ExtraFileError, match='holds notes.txt, not listed in manifest.json'):
        manifest.verify_folder(folder, world['trusted'])
    folder = _copy(world, 'v1', tmp_path / 'c')
    (folder / 'model.yaml').rename(tmp_path / 'outside.yaml')
    (folder / 'model.yaml').symlink_to(tmp_path / 'outside.yaml')
    with pytest.raises(ExtraFileError, match='model.yaml is not a regular file'):
        manifest.verify_folder(folder, world['trusted'])
    folder = _copy(world, 'v1', tmp_path / 'd')
    (folder / 'manifest.sig').unlink()
    with pytest.raises(SignatureError, match='has no manifest.sig: sign the folder'):
        manifest.verify_folder(folder, world['trusted'])


def test_public_key_forms(world, tmp_path):
    text = world['public'].read_text().strip()
    assert signing.key_id(signing.load_public(text)) == signing.key_id(world['trusted'])
    pem = tmp_path / 'k.pem'
    pem.write_bytes(world['trusted'].public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    assert signing.key_id(signing.load_public(str(pem))) == signing.key_id(world['trusted'])
    with pytest.raises(KeyFormatError, match='neither an existing key file nor the base64'):
        signing.load_public('/no/such/key.pub')
    short = tmp_path / 'short.pub'
    short.write_text(base64.b64encode(b'x' * 31).decode())
    with pytest.raises(KeyFormatError, match='is not an ed25519 public key'):
        signing.load_public(str(short))
    with pytest.raises(KeyFormatError, match='exists: refusing to overwrite'):
        signing.generate(world['private'], tmp_path / 'new.pub')
    assert os.stat(world['private']).st_mode & 0o777 == 0o600


def test_delta_applies_to_the_same_folder_as_the_full_copy(world, tmp_path):
    full_root, delta_root = ModelsRoot(tmp_path / 'full'), ModelsRoot(tmp_path / 'delta')
    full = full_root.install(world['v2'], world['trusted'])
    patched = delta_root.install(world['delta'], world['trusted'], base=world['v1'])
    assert not patched.reused and patched.path.name == full.path.name
    for name in sorted(p.name for p in full.path.iterdir()):
        assert (patched.path / name).read_bytes() == (full.path / name).read_bytes(), name
    assert (patched.path / 'model.onnx.data').read_bytes() == (
        world['v2'] / 'model.onnx.data').read_bytes()
    delta_root.switch(patched.path, world['trusted'])
    assert delta_root.current() == patched.path
    engine = Engine(EngineConfig(model_dir=str(delta_root.current_link), max_context=64))
    try:
        assert engine.model_name == 'tiny-v2'
    finally:
        engine.close()
    # The same content again: reused, not written twice; tampered input is still refused.
    assert delta_root.install(world['v2'], world['trusted']).reused
    tampered = _copy(world, 'v2', tmp_path)
    (tampered / 'model.yaml').write_text((tampered / 'model.yaml').read_text() + '#')
    with pytest.raises(HashMismatchError, match='model.yaml has'):
        delta_root.install(tampered, world['trusted'])


def test_truncated_or_corrupt_delta_is_refused(world, tmp_path):
    package = _copy(world, 'delta', tmp_path)
    patch = package / delta.PATCH_FILE
    size = patch.stat().st_size
    os.truncate(patch, size // 2)
    root = ModelsRoot(tmp_path / 'root')
    with pytest.raises(DeltaError, match=f'has {size // 2} bytes, delta.json says {size}: the '
                                         'delta is truncated or corrupt'):
        root.install(package, world['trusted'], base=world['v1'])
    package = _copy(world, 'delta', tmp_path / 'b')
    data = bytearray((package / delta.PATCH_FILE).read_bytes())
    data[len(data) // 2] ^= 0x55
    (package / delta.PATCH_FILE).write_bytes(bytes(data))
    with pytest.raises(DeltaError, match='does not have the sha256 delta.json gives'):
        root.install(package, world['trusted'], base=world['v1'])
    # Made for another base: v2 is not what the patch applies to.
    with pytest.raises(DeltaError, match='made for another base model'):
        root.install(world['delta'], world['trusted'], base=world['v2'])
    package = _copy(world, 'delta', tmp_path / 'c')
    (package / 'delta.sig').unlink()
    with pytest.raises(SignatureError, match='has no delta.sig'):
        root.install(package, world['trusted'], base=world['v1'])
    assert root.installed() == [] and list(root.staging.iterdir()) == []


def test_delta_ships_only_what_differs_from_the_base(world, tmp_path):
    found = delta.Delta.from_bytes((world['delta'] / 'delta.json').read_bytes())
    shipped = {p.name for p in world['delta'].iterdir()}
    assert 'tokenizer.json' in found.from_base and 'tokenizer.json' not in shipped
    assert 'model.yaml' not in found.from_base and 'model.yaml' in shipped   # renamed
    assert 'model.onnx.data' not in shipped and delta.PATCH_FILE in shipped
    # A base whose unchanged file differs after all: refused, nothing installed.
    base = _copy(world, 'v1', tmp_path)
    (base / 'tokenizer.json').write_bytes((base / 'tokenizer.json').read_bytes() + b' ')
    root = ModelsRoot(tmp_path / 'root')
    with pytest.raises(DeltaError, match='tokenizer.json has .* bytes, the signed manifest '
                                         'says .*made against another base model'):
        root.install(world['delta'], world['trusted'], base=base)
    (base / 'tokenizer.json').unlink()
    with pytest.raises(DeltaError, match='takes tokenizer.json from the base model, but'):
        root.install(world['delta'], world['trusted'], base=base)
    assert root.installed() == [] and list(root.staging.iterdir()) == []


def test_delta_package_with_a_foreign_manifest_is_refused(world, tmp_path):
    package = _copy(world, 'delta', tmp_path)
    for name in ('manifest.json', 'manifest.sig'):
        shutil.copyfile(world['v1'] / name, package / name)
    with pytest.raises(DeltaError, match='was made for another manifest.json'):
        delta.verified_delta(package, world['trusted'])


def test_cli_round_trip_and_refusal(world, tmp_path, capsys):
    os.chdir(tmp_path)
    assert cli.main(['keygen', 'k']) == 0
    folder = pathlib.Path(shutil.copytree(world['v1'], tmp_path / 'model'))
    assert cli.main(['sign', str(folder), '--key', 'k.key']) == 0
    assert cli.main(['verify', str(folder), '--public-key', 'k.pub']) == 0
    assert cli.main(['apply', str(folder), '--root', 'root', '--public-key', 'k.pub',
                     '--switch']) == 0
    out = capsys.readouterr().out
    assert 'installed: ' in out and 'current -> tiny-v1-' in out
    assert cli.main(['verify', str(folder), '--public-key', str(world['public'])]) == 1
    err = capsys.readouterr().err
    assert err.startswith('edge-llm-update: error: ') and 'signed by key' in err
    assert cli.main(['apply', str(world['v2']), '--root', 'root', '--public-key', 'k.pub']) == 1
    assert 'signed by key' in capsys.readouterr().err
    assert [p.name for p in ModelsRoot(tmp_path / 'root').installed()] == [
        os.readlink(tmp_path / 'root' / 'current').split('/')[-1]]
