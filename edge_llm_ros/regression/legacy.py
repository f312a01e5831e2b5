"""Records of older interface versions, translated to the current semantics in one place.

Interface version 1 (before issue 13) had no `interface_version` field in Transcript; bags
recorded then are decoded with their own stored definitions (regression.bagio), so their
records simply lack the newer fields, which take their defaults. What changed meaning is
translated here:

- SamplingParams.presence_penalty had no unset value: 0.0 meant "node default". Version 2
  has UNSET_PENALTY for that (0.0 now means "disabled"), so a version-1 request's 0.0
  becomes UNSET_PENALTY: replayed, it again asks for the node's default.
- frequency_penalty, logit_bias and top_logprobs did not exist. In the request they are
  unset (read with their defaults). In the effective sampling a version-1 node applied no
  frequency penalty and reported no logprobs: 0.0 and UNSET_INT, as a version-2 node
  reports them for such a request. An effective sampling that was never filled (refused
  request: every field unset) stays unset.

Interface version 3 (issue 14) only added fields: Generate.Goal/Transcript `priority` and
`preempt`, Generate.Feedback `paused`. A version-2 record lacks them and reads them as 0,
false (normal priority, no preemption), which is exactly how a version-2 node served every
goal: version-2 records need no translation. Version-1 ones get the translation above.

Interface version 4 (issue 20) changed what a session is: before, `session_id` only named a
KV prefix to keep (each goal carried its whole conversation); now the node remembers the
session's turns and puts them before the goal's. A record of an older version is therefore
replayed without its session_id: prefix reuse needs no name, so the goal sees exactly the
prompt it saw then.

Interface version 5 (issue 23) only added fields: Generate.Goal/Transcript `no_speculation`
and Timings' speculation counts. Speculation never changes an output, so an older record
(read as false: the node's own mode) needs no translation.

Interface version 6 (issue 22) only added fields: Generate.Goal/Transcript `images` (tensor
handles of frames for a vision model) and `raw_prompt`. An older record reads them as no
images and false (the chat template applies), which is how every older goal was served: it
needs no translation.

Interface version 7 (issue 40) only added fields: Generate.Goal/Transcript `max_image_tokens`
and the result's `detections`. An older record reads 0 (the node's cap: older nodes had none)
and no detections; it needs no translation.

Interface version 8 (issue 40) only added fields: Generate.Goal/Transcript `video_frames`,
`video_timestamps` and `video_fps` (a clip for a Qwen-VL model). An older record reads no
clip, which is how every older goal was served: it needs no translation.

Interface version 9 (issue 40) only added fields: Generate.Goal/Transcript
`video_window_source`, `video_window_seconds` and `video_window_max_frames` (the clip named as
a perception node's time window). A record of such a goal carries the clip the window resolved
to in its video fields, which replay resends; an older record reads no window.
"""
from __future__ import annotations

from dataclasses import replace

from edge_llm_ros.regression.records import SamplingRecord, TranscriptRecord, UNSET_PENALTY

# The first version whose sampling means what it means today (see the module docstring).
SAMPLING_SEMANTICS_SINCE = 2
# The first version whose session_id is a remembered conversation.
CONVERSATIONS_SINCE = 4


def request_sampling_v1(sampling: SamplingRecord) -> SamplingRecord:
    """Return a version-1 goal's SamplingParams in version-2 terms."""
    if sampling.presence_penalty == 0.0:
        sampling = replace(sampling, presence_penalty=UNSET_PENALTY)
    return sampling


def effective_sampling_v1(sampling: SamplingRecord) -> SamplingRecord:
    """Return what a version-1 node reported as applied, in version-2 terms."""
    if sampling.temperature < 0.0:   # never filled: the request was refused
        return request_sampling_v1(sampling)
    return replace(sampling, frequency_penalty=0.0)


def upgrade(record: TranscriptRecord) -> TranscriptRecord:
    """Return `record` in the current semantics (unchanged when already current)."""
    if record.interface_version < CONVERSATIONS_SINCE and record.session_id:
        record = replace(record, session_id='')
    if record.interface_version >= SAMPLING_SEMANTICS_SINCE:
        return record
    return replace(record, sampling=request_sampling_v1(record.sampling),
                   effective_sampling=effective_sampling_v1(record.effective_sampling))
