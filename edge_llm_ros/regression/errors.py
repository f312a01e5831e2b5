"""Typed errors of the bag regression tools. Every message says what the user should do."""


class RegressionToolError(Exception):
    """Base class of every error the record/replay/report tools raise on purpose."""

    #: Process exit status the command-line tools use for this error.
    exit_code = 2


class BagNotFoundError(RegressionToolError):
    """The bag path does not exist or holds no rosbag2 metadata."""


class BagCorruptError(RegressionToolError):
    """The bag's metadata or storage file cannot be read."""


class BagTypeMismatchError(RegressionToolError):
    """A topic in the bag was recorded with another version of its interface type."""


class BagContentError(RegressionToolError):
    """The bag is readable but does not hold what the tool needs (e.g. no transcripts)."""


class InterfaceDefinitionError(RegressionToolError):
    """The edge_llm_msgs interface files (.msg/.action) cannot be found or parsed."""


class ThresholdsError(RegressionToolError):
    """The thresholds YAML is missing, malformed or has unknown keys."""


class CpuClassError(RegressionToolError, ValueError):
    """A CPU class (given with --cpu-class or stored in a bag) is malformed."""


class NodeUnavailableError(RegressionToolError):
    """The llm_node to replay against did not answer (no action server)."""

    exit_code = 3
