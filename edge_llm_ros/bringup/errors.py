"""Typed bring-up errors: every message names what is wrong and what to do about it.

They are raised at launch or configure time, never at the first token.
"""


class BringupError(Exception):
    """Base class of every error the bring-up code raises on purpose."""


class ProfileFormatError(BringupError, ValueError):
    """A profile or parameters file is not valid YAML or not shaped like a ROS params file."""


class UnknownParameterError(BringupError, KeyError):
    """A parameter name that no node declares (typo, or a key of another node)."""

    def __str__(self) -> str:
        # KeyError would print the message repr()'d; keep it readable.
        return str(self.args[0]) if self.args else ''


class ParameterTypeError(BringupError, TypeError):
    """A parameter value of the wrong type (ROS rejects 85 for a double: write 85.0)."""


class ParameterRangeError(BringupError, ValueError):
    """A parameter value outside its range or not among its choices."""


class UnknownBoardError(BringupError, ValueError):
    """A board name with no profile, or `auto` on a machine no profile matches."""


class BoardDetectionError(BringupError):
    """The machine description under the given root cannot be read."""


class AffinityError(BringupError, ValueError):
    """A CPU list that is malformed or names cores this machine does not have."""


class KernelSupportError(BringupError):
    """The installed CUDA toolchain cannot build the profile's kernel set for its SM arch."""


class ProviderError(BringupError):
    """The profile asks for an ONNX Runtime execution provider this installation lacks."""


class ThermalError(BringupError):
    """Thermal settings that contradict each other (resume above limit, ...)."""
