"""yaml.safe_load for files people write, refusing deep nesting and alias bombs.

Board profiles and params files (bringup/profiles.py) and model family configs
(runtime/model_config.py) are read through here; each caller turns YamlFormatError into its
own typed error. Imports nothing of edge_llm_ros, so any layer may read it.
"""
from typing import Any

import yaml

# YAML aliases share nodes: a few lines can expand into billions (an "alias bomb"). A real
# params file has tens of values; refuse documents that expand past this many nodes.
MAX_YAML_NODES = 100_000


class YamlFormatError(ValueError):
    """The text is not valid YAML, nests too deeply, or expands past MAX_YAML_NODES."""


def safe_load_bounded(text: str, source: str) -> Any:
    """yaml.safe_load, refusing deep nesting and alias bombs with YamlFormatError."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, 'problem_mark', None)
        where = ' line %d column %d' % (mark.line + 1, mark.column + 1) if mark else ''
        problem = getattr(exc, 'problem', None) or str(exc)
        raise YamlFormatError('%s:%s is not valid YAML: %s' % (source, where, problem)) \
            from None
    except RecursionError:
        raise YamlFormatError('%s: YAML nested too deeply' % source) from None
    # Count nodes as later code will walk them (an alias counts every time it is used).
    stack, seen = [doc], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_YAML_NODES:
            raise YamlFormatError('%s: the YAML expands to more than %d values (aliases '
                                  'referring to aliases?); write the values out' % (
                                      source, MAX_YAML_NODES))
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return doc
