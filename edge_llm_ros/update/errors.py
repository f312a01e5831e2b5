"""Typed errors of model updates; every message says what is wrong and what to do."""


class UpdateError(Exception):
    """Base class: the update was refused and nothing was installed or switched."""


class KeyFormatError(UpdateError):
    """A key file or base64 string is not an ed25519 key of the expected kind."""


class ManifestError(UpdateError):
    """manifest.json (or delta.json) is missing, not canonical JSON or breaks the schema."""


class UnknownFieldError(ManifestError):
    """The manifest has a field this version does not know (never silently ignored)."""


class SignatureError(UpdateError):
    """The signature file is missing or malformed, or does not verify."""


class WrongKeyError(SignatureError):
    """Signed by another key than the trusted one."""


class BadSignatureError(SignatureError):
    """The signature does not match the manifest's bytes (tampered, or signed other bytes)."""


class FolderMismatchError(UpdateError):
    """The folder does not hold exactly the files of its manifest (base of the next three)."""


class MissingFileError(FolderMismatchError):
    """A file the manifest lists is absent."""


class ExtraFileError(FolderMismatchError):
    """The folder holds a file the manifest does not list."""


class HashMismatchError(FolderMismatchError):
    """A file's size or sha256 differs from the manifest (tampered or corrupt)."""


class DeltaError(UpdateError):
    """A delta package is truncated, corrupt, or made for another base model."""


class DiskFullError(UpdateError):
    """The disk filled up while the update was written; nothing was installed."""


class InstallError(UpdateError):
    """The models root is unusable (not a folder, `current` not a symlink, ...)."""
