"""Record the rows of every call an engine's decoder runs (OnnxDecoder.run), for tests."""
from typing import List


def record_calls(decoder) -> List[list]:
    """Wrap this decoder's run(); return the list that each call's rows are appended to."""
    calls: List[list] = []
    run = decoder.run

    def recording(rows):
        calls.append(list(rows))
        return run(rows)
    decoder.run = recording
    return calls
