"""ed25519 keys and detached signatures of canonical JSON files (`cryptography`).

Keys: `keygen` writes the private key as PEM (PKCS#8, mode 0600; openssl reads it) and the
public key as the base64 of its 32 raw bytes, which is also what the `update.public_key`
parameter may hold inline. PEM public keys are read too.
Signature files (manifest.sig, delta.sig) are canonical JSON:
  {"algorithm": "ed25519", "key_id": <16 hex>, "signature": <base64 of 64 bytes>}
key_id (the first 16 hex digits of the sha256 of the raw public key) is not trusted: it only
lets a refusal say "signed by another key" rather than "signature does not match".
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import pathlib
from typing import Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey, Ed25519PublicKey)

from edge_llm_ros.update import canonical
from edge_llm_ros.update.errors import (BadSignatureError, KeyFormatError, ManifestError,
                                        SignatureError, WrongKeyError)

ALGORITHM = 'ed25519'
_SIG_FIELDS = {'algorithm': str, 'key_id': str, 'signature': str}
MAX_KEY_FILE_BYTES = 16 * 1024


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """Short, stable name of a public key (shown in messages)."""
    return hashlib.sha256(raw_public(key)).hexdigest()[:16]


def generate(private_path: Union[str, pathlib.Path],
             public_path: Union[str, pathlib.Path]) -> Ed25519PublicKey:
    """Write a new key pair (refuses to overwrite either file); return the public key."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = private.public_key()
    for path in (private_path, public_path):
        if os.path.lexists(path):
            raise KeyFormatError(f'{path} exists: refusing to overwrite a key; pick another '
                                 'name or delete it first')
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, 'wb') as fh:
        fh.write(pem)
    pathlib.Path(public_path).write_text(
        base64.b64encode(raw_public(public)).decode('ascii') + '\n')
    return public


def load_private(path: Union[str, pathlib.Path]) -> Ed25519PrivateKey:
    """Read a private key file: PEM (PKCS#8, unencrypted) or base64 of the raw 32 bytes."""
    data = _read_key_file(pathlib.Path(path), 'private')
    if data.lstrip().startswith(b'-----BEGIN'):
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFormatError(f'{path} is not an unencrypted PEM private key ({exc})') from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFormatError(f'{path} holds a {type(key).__name__}, not an ed25519 key: '
                                 'make one with edge-llm-update keygen')
        return key
    return Ed25519PrivateKey.from_private_bytes(_raw32(data, str(path), 'private'))


def load_public(spec: str) -> Ed25519PublicKey:
    """Read a public key from a file (base64 raw or PEM) or from a base64 string itself."""
    spec = spec.strip()
    if not spec:
        raise KeyFormatError('no public key given')
    path = pathlib.Path(spec).expanduser()
    if path.is_file():
        data = _read_key_file(path, 'public')
        where = str(path)
    else:
        data, where = spec.encode('ascii', 'replace'), 'the inline key'
    if data.lstrip().startswith(b'-----BEGIN'):
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as exc:
            raise KeyFormatError(f'{where} is not a PEM public key ({exc})') from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFormatError(f'{where} holds a {type(key).__name__}, not an ed25519 key')
        return key
    try:
        raw = _raw32(data, where, 'public')
    except KeyFormatError:
        if where == 'the inline key':
            raise KeyFormatError(
                f'{spec!r} is neither an existing key file nor the base64 of a raw 32-byte '
                'ed25519 public key (edge-llm-update keygen writes one as <name>.pub)') from None
        raise
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(data: bytes, private: Ed25519PrivateKey) -> bytes:
    """Return the signature file's bytes for `data` (canonical JSON)."""
    return canonical.dumps({'algorithm': ALGORITHM, 'key_id': key_id(private.public_key()),
                            'signature': base64.b64encode(private.sign(data)).decode('ascii')})


def verify(data: bytes, signature_file: bytes, trusted: Ed25519PublicKey, what: str,
           sig_name: str) -> None:
    """Check `signature_file` over `data` with the trusted key; SignatureError subclasses."""
    try:
        sig = canonical.fields(canonical.loads(signature_file, sig_name), _SIG_FIELDS, sig_name)
    except ManifestError as exc:
        raise SignatureError(f'{sig_name} is malformed: {exc}') from None
    if sig['algorithm'] != ALGORITHM:
        raise SignatureError(f'{sig_name} uses algorithm {sig["algorithm"]!r}; only '
                             f'{ALGORITHM} is accepted')
    try:
        raw = base64.b64decode(sig['signature'], validate=True)
    except binascii.Error:
        raise SignatureError(f'{sig_name}: the signature is not base64') from None
    trusted_id = key_id(trusted)
    if sig['key_id'] != trusted_id:
        raise WrongKeyError(
            f'{what} is signed by key {sig["key_id"]}, but the trusted public key is '
            f'{trusted_id}: sign it with the matching private key, or configure the public '
            'key of the key that signed it')
    try:
        trusted.verify(raw, data)
    except InvalidSignature:
        raise BadSignatureError(
            f'{sig_name} does not match the bytes of {what}: {what} was changed after it was '
            'signed, or the signature was made over other bytes; do not use it, sign the '
            'original again') from None


def _read_key_file(path: pathlib.Path, kind: str) -> bytes:
    try:
        with open(path, 'rb') as fh:
            data = fh.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFormatError(f'cannot read the {kind} key {path}: {exc.strerror}') from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFormatError(f'{path} is too large to be an ed25519 {kind} key')
    return data


def _raw32(data: bytes, where: str, kind: str) -> bytes:
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b''
    if len(raw) != 32:
        raise KeyFormatError(f'{where} is not an ed25519 {kind} key (expected PEM or the '
                             'base64 of 32 raw bytes, as edge-llm-update keygen writes)')
    return raw
