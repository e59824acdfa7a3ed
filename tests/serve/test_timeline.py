"""deployments/timeline.py: per-code marks and the split of a first audio's latency into stages."""
from __future__ import annotations

from deployments.timeline import MAX_CODES, OPTIONAL_MARKS, STAGES, first_audio_stages, stamp_codes
from runtime.request import TIMELINE_CODES


def test_the_deployments_keep_as_many_code_marks_as_the_engine() -> None:
    assert MAX_CODES == TIMELINE_CODES


def test_stamp_codes_marks_each_code_of_an_event_and_stops_at_the_cap() -> None:
    times: list[float] = []
    stamp_codes(times, 3, now=1.0)
    stamp_codes(times, 0, now=2.0)
    stamp_codes(times, MAX_CODES, now=3.0)
    stamp_codes(times, 1, now=4.0)
    assert times == [1.0] * 3 + [3.0] * (MAX_CODES - 3)


def _timeline(n: int) -> dict:
    """Marks one millisecond-ish apart, the k-th code's marks at distinct times (n codes before the step)."""
    return {
        "ingress_received": 10.001, "vocoder_received": 10.003, "llm_received": 10.006,
        "engine_arrived": 10.010, "engine_first_scheduled": 10.015,
        "engine_codes": [10.030 + 0.005 * k for k in range(8)],
        "llm_codes_sent": [10.031 + 0.005 * k for k in range(8)],
        "vocoder_codes_received": [10.033 + 0.005 * k for k in range(8)],
        "vocoder_first_chunk_codes": n, "vocoder_first_step_started": 10.060, "vocoder_first_pcm": 10.075,
        "ingress_first_audio": 10.077,
    }


def test_stages_run_from_the_send_to_the_first_audio_through_the_nth_codes_marks() -> None:
    stages = first_audio_stages(_timeline(5), sent_at=10.0, first_audio_at=10.080)
    assert stages is not None and list(stages) == [name for name, mark in STAGES if mark not in OPTIONAL_MARKS]
    expected = {
        "client_to_ingress": 0.001, "ingress_to_vocoder": 0.002, "vocoder_to_llm": 0.003, "llm_to_engine": 0.004,
        "engine_queue": 0.005, "first_code": 0.015, "more_codes": 0.020, "llm_send": 0.001,
        "llm_to_vocoder": 0.002, "vocoder_wait": 0.007, "vocoder_first_chunk": 0.015,
        "vocoder_to_ingress": 0.002, "ingress_to_client": 0.003,
    }
    assert {k: round(v, 9) for k, v in stages.items()} == expected
    assert round(sum(stages.values()), 9) == 0.080  # the stages add up to the time to first audio


def test_speech_input_adds_its_encoding_stage_between_the_vocoder_and_the_llm() -> None:
    timeline = {**_timeline(5), "vocoder_speech_encoded": 10.0045}
    stages = first_audio_stages(timeline, sent_at=10.0, first_audio_at=10.080)
    assert stages is not None and list(stages) == [name for name, _ in STAGES]
    assert round(stages["speech_encode"], 9) == 0.0015 and round(stages["vocoder_to_llm"], 9) == 0.0015
    assert round(sum(stages.values()), 9) == 0.080


def test_stages_are_none_when_a_mark_is_missing_or_past_the_kept_codes() -> None:
    assert first_audio_stages(_timeline(9), 10.0, 10.08) is None  # only 8 codes marked in this timeline
    assert first_audio_stages(_timeline(0), 10.0, 10.08) is None
    no_pcm = {k: v for k, v in _timeline(5).items() if k != "vocoder_first_pcm"}
    assert first_audio_stages(no_pcm, 10.0, 10.08) is None
    assert first_audio_stages({}, 10.0, 10.08) is None
