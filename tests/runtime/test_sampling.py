"""Sampling of (text, audio) rows on hand-made logits: masks, penalty, greedy, top-k/top-p, modality, seeds."""
from __future__ import annotations

import math
import random

import pytest
import torch

from runtime import sampling
from runtime.config import AUDIO_PAD_ID, ENDOFTEXT_ID, EOSP_ID, IM_END_ID, MODALITY_PAD_ID, SOSP_ID
from runtime.sampling import (
    RequestSampler,
    SamplingParams,
    apply_repetition_penalty,
    is_stop_row,
    sample_next_rows,
    sample_tokens,
    splitmix64,
)

TEXT_VOCAB = 151680
AUDIO_VOCAB = 16512
SMALL_TEXT_VOCAB = 16
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
TEXT_PROMPT = [(1, AUDIO_PAD_ID), (2, AUDIO_PAD_ID)]
AUDIO_PROMPT = [(1, AUDIO_PAD_ID), (SOSP_ID, AUDIO_PAD_ID)]  # ends in [SOSP, AUDIO_PAD]: audio mode


def logits_row(size: int, values: dict[int, float], fill: float = 0.0) -> torch.Tensor:
    """A [1, size] float32 logits tensor: ``fill`` everywhere except ``values``."""
    row = torch.full((1, size), fill, dtype=torch.float32)
    for index, value in values.items():
        row[0, index] = value
    return row


def sampler(prompt=TEXT_PROMPT, text=GREEDY, audio=GREEDY, *, min_new_tokens=0, seed=0) -> RequestSampler:
    return RequestSampler(prompt, text, audio, min_new_tokens=min_new_tokens, seed=seed)


def step(s: RequestSampler, text: dict[int, float], audio: dict[int, float], text_vocab=TEXT_VOCAB):
    return sample_next_rows(logits_row(text_vocab, text), logits_row(AUDIO_VOCAB, audio), [s])[0]


# ---- masks -------------------------------------------------------------------------------------------


def test_audio_ids_above_eosp_are_never_sampled() -> None:
    huge = {i: 1e4 for i in range(EOSP_ID + 1, AUDIO_VOCAB)}
    s = sampler(AUDIO_PROMPT, audio=GREEDY)
    assert step(s, {3: 1.0}, {**huge, 7: 1.0}) == (MODALITY_PAD_ID, 7)
    # Sampling: only ids 3 and 9 are finite below EOSP; 300 draws never leave {3, 9} and hit both.
    samplers = [sampler(AUDIO_PROMPT, audio=PLAIN, seed=seed) for seed in range(300)]
    audio = logits_row(AUDIO_VOCAB, {**huge, 3: 0.0, 9: 0.0}, fill=-math.inf).repeat(300, 1)
    rows = sample_next_rows(torch.zeros(300, SMALL_TEXT_VOCAB), audio, samplers)
    assert {row[1] for row in rows} == {3, 9}


def test_eosp_masked_until_min_new_tokens() -> None:
    s = sampler(AUDIO_PROMPT, min_new_tokens=2)
    audio = {EOSP_ID: 5.0, 11: 1.0}
    assert step(s, {3: 1.0}, audio) == (MODALITY_PAD_ID, 11)
    assert step(s, {3: 1.0}, audio) == (MODALITY_PAD_ID, 11)
    assert step(s, {3: 1.0}, audio) == (MODALITY_PAD_ID, EOSP_ID)  # 2 generated: EOSP allowed
    assert s.mode == "text"
    assert list(s.audio_codes) == [11, 11]
    assert s.last_output_code is None


def test_eosp_allowed_at_once_without_min_new_tokens() -> None:
    s = sampler(AUDIO_PROMPT, min_new_tokens=0)
    assert step(s, {3: 1.0}, {EOSP_ID: 5.0, 11: 1.0}) == (MODALITY_PAD_ID, EOSP_ID)


# ---- repetition penalty --------------------------------------------------------------------------------


def test_apply_repetition_penalty_exact_values() -> None:
    logits = torch.tensor([[3.0, -2.0, 0.0, 1.5, -1.0], [3.0, -2.0, 0.0, 1.5, -1.0]])
    seen = torch.tensor([[True, True, True, False, False], [False, False, False, True, True]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([1.5, 2.0]))
    assert out.tolist() == [[2.0, -3.0, 0.0, 1.5, -1.0], [3.0, -2.0, 0.0, 0.75, -2.0]]
    assert logits.tolist()[0] == [3.0, -2.0, 0.0, 1.5, -1.0]  # input untouched


def greedy_with_penalty(penalty: float) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=penalty)


@pytest.mark.parametrize(
    ("logits", "penalty", "expected"),
    [
        # Token 1 is in the prompt history. Positive: 2.0 / 1.1 = 1.818 < 1.9, but 2.0 / 1.05 = 1.905 > 1.9.
        ({1: 2.0, 3: 1.9}, 1.1, 3),
        ({1: 2.0, 3: 1.9}, 1.05, 1),
        # Negative: -1.0 * 1.1 = -1.1 < -1.05, but -1.0 * 1.02 = -1.02 > -1.05.
        ({1: -1.0, 3: -1.05}, 1.1, 3),
        ({1: -1.0, 3: -1.05}, 1.02, 1),
        # A penalty below 1 favours repeats: 1.0 / 0.5 = 2.0 > 1.5.
        ({1: 1.0, 3: 1.5}, 0.5, 1),
    ],
)
def test_penalty_decides_greedy(logits: dict[int, float], penalty: float, expected: int) -> None:
    s = sampler(text=greedy_with_penalty(penalty))
    text = logits_row(SMALL_TEXT_VOCAB, logits, fill=-math.inf)
    row = sample_next_rows(text, logits_row(AUDIO_VOCAB, {}), [s])[0]
    assert row[0] == expected


def test_channel_histories_are_separate_and_grow() -> None:
    penalised = greedy_with_penalty(1.1)
    s = sampler([(5, 7)], text=penalised, audio=penalised)
    # Text history {5}: 5 drops to 1.818 and 7 wins; audio history {7}: 7 drops and 5 wins.
    text, audio = {5: 2.0, 7: 1.95}, {7: 2.0, 5: 1.95}
    assert step(s, text, audio, SMALL_TEXT_VOCAB) == (7, 5)
    # Now text history {5, 7} and audio {7, 5}: 2.0/1.1 = 1.818 > 1.95/1.1 = 1.773 on both channels.
    assert step(s, text, audio, SMALL_TEXT_VOCAB) == (5, 7)


def test_generated_token_is_penalised_next_step() -> None:
    penalised = greedy_with_penalty(1.1)
    s = sampler([(0, 0)], text=penalised, audio=GREEDY)
    assert step(s, {1: 2.0, 2: 1.9}, {4: 1.0}, SMALL_TEXT_VOCAB) == (1, 4)
    assert step(s, {1: 2.0, 2: 1.9}, {4: 1.0}, SMALL_TEXT_VOCAB) == (2, 4)


def test_text_history_holds_modality_pad_of_audio_rows() -> None:
    # The prompt has no MODALITY_PAD; the two audio-mode rows put it into the text history as appended.
    s = sampler(AUDIO_PROMPT, text=greedy_with_penalty(1.1))
    assert step(s, {42: 1.0}, {5: 1.0}) == (MODALITY_PAD_ID, 5)
    assert step(s, {42: 1.0}, {EOSP_ID: 1.0}) == (MODALITY_PAD_ID, EOSP_ID)
    # 2.0 / 1.1 = 1.818 < 1.9: the pad is penalised like any repeated id.
    assert step(s, {MODALITY_PAD_ID: 2.0, 42: 1.9}, {5: 1.0}) == (42, 5)
    fresh = sampler(TEXT_PROMPT, text=greedy_with_penalty(1.1))
    assert step(fresh, {MODALITY_PAD_ID: 2.0, 42: 1.9}, {5: 1.0}) == (MODALITY_PAD_ID, 5)


# ---- greedy, top-k, top-p, inverse CDF ------------------------------------------------------------------


def test_greedy_ties_pick_lowest_index() -> None:
    s = sampler(AUDIO_PROMPT[:1])
    assert step(s, {1: 3.0, 4: 3.0, 9: 3.0}, {2: 5.0, 6: 5.0}, SMALL_TEXT_VOCAB) == (1, 2)


@pytest.mark.parametrize("temperature", [1e-46, 1e-40, 9.9e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature: float) -> None:
    """Below GREEDY_BELOW a temperature is greedy. 1e-46 rounds to 0 in float32, and the draw used to return
    index 0 instead of the argmax; 1e-40 scales the logits past float32's range. As greedy, the tie between
    indices 3 and 5 goes to the lowest index on every draw."""
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0)
    params.validate()
    assert params.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    logits = torch.tensor([[0.0, -1.0, -2.0, 30.0, -0.5, 30.0]]).repeat(3, 1)
    picks = sample_tokens(logits, [params] * 3, torch.tensor([0.0, 0.5, 0.999]))
    assert picks.tolist() == [3, 3, 3]


def test_sample_tokens_inverse_cdf_exact() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]])).repeat(4, 1)  # [4, 3]
    uniforms = torch.tensor([0.1, 0.6, 0.9, 0.0])
    picks = sample_tokens(logits, [PLAIN] * 4, uniforms)
    assert picks.tolist() == [0, 1, 2, 0]


def test_sample_tokens_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one SamplingParams and one uniform per row"):
        sample_tokens(torch.zeros(2, 3), [PLAIN], torch.zeros(2))


def _support(params: SamplingParams, probs: list[float], num_draws: int = 400) -> set[int]:
    """The set of text ids drawn by ``num_draws`` requests (seeds 0..n-1) from ``log(probs)``."""
    samplers = [sampler(text=params, seed=seed) for seed in range(num_draws)]
    text = torch.log(torch.tensor(probs)).unsqueeze(0).repeat(num_draws, 1)  # [n, V]
    rows = sample_next_rows(text, torch.zeros(num_draws, AUDIO_VOCAB), samplers)
    return {row[0] for row in rows}


PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]  # descending order of ids: 1, 3, 4, 2, 0


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (PLAIN, {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=1, repetition_penalty=1.0), {1}),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=2, repetition_penalty=1.0), {1, 3}),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=5, repetition_penalty=1.0), {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=99, repetition_penalty=1.0), {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=1.0, top_p=0.3, top_k=0, repetition_penalty=1.0), {1}),
        (SamplingParams(temperature=1.0, top_p=0.65, top_k=0, repetition_penalty=1.0), {1, 3}),
        (SamplingParams(temperature=1.0, top_p=0.75, top_k=0, repetition_penalty=1.0), {1, 3, 4}),
        # top-p renormalises over the top-3 set {1: .47, 3: .35, 4: .18}: 0.85 keeps all three.
        (SamplingParams(temperature=1.0, top_p=0.85, top_k=3, repetition_penalty=1.0), {1, 3, 4}),
        (SamplingParams(temperature=1.0, top_p=0.8, top_k=3, repetition_penalty=1.0), {1, 3}),
    ],
)
def test_top_k_top_p_support_is_exact(params: SamplingParams, support: set[int]) -> None:
    assert _support(params, PROBS) == support


def test_top_k_keeps_ties_with_kth_value() -> None:
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=2, repetition_penalty=1.0)
    assert _support(params, [0.3, 0.3, 0.3, 0.1]) == {0, 1, 2}


# ---- modality and stop rows -----------------------------------------------------------------------------


def test_modality_transitions_and_overwrite() -> None:
    s = sampler(TEXT_PROMPT)
    assert s.mode == "text"
    assert step(s, {42: 1.0}, {EOSP_ID: 3.0}) == (42, EOSP_ID)  # EOSP in text mode: kept, no transition
    assert s.mode == "text" and s.last_output_code is None
    assert step(s, {SOSP_ID: 1.0}, {9: 1.0}) == (SOSP_ID, 9)
    assert s.mode == "audio" and s.last_output_code is None
    assert step(s, {IM_END_ID: 1.0}, {5: 1.0}) == (MODALITY_PAD_ID, 5)  # text overwritten in audio mode
    assert s.mode == "audio" and s.last_output_code == 5
    assert step(s, {SOSP_ID: 1.0}, {6: 1.0}) == (MODALITY_PAD_ID, 6)  # SOSP in audio mode: no transition
    assert step(s, {42: 1.0}, {EOSP_ID: 1.0}) == (MODALITY_PAD_ID, EOSP_ID)
    assert s.mode == "text" and s.last_output_code is None
    assert step(s, {IM_END_ID: 1.0}, {7: 1.0}) == (IM_END_ID, 7)
    assert list(s.audio_codes) == [5, 6]
    assert s.num_generated == 6
    assert list(s.generated_rows)[-1] == (IM_END_ID, 7)


def test_initial_mode_comes_from_prompt() -> None:
    assert sampler(AUDIO_PROMPT).mode == "audio"
    assert sampler(TEXT_PROMPT).mode == "text"
    assert sampler([]).mode == "text"


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ((IM_END_ID, AUDIO_PAD_ID), True),
        ((ENDOFTEXT_ID, 3), True),
        ((SOSP_ID, IM_END_ID), False),
        ((MODALITY_PAD_ID, EOSP_ID), False),
        ((42, 0), False),
    ],
)
def test_is_stop_row(row: tuple[int, int], expected: bool) -> None:
    assert is_stop_row(row) is expected


def test_stop_token_in_audio_mode_is_overwritten_so_no_stop() -> None:
    text_mode, audio_mode = sampler(TEXT_PROMPT), sampler(AUDIO_PROMPT)
    assert is_stop_row(step(text_mode, {ENDOFTEXT_ID: 1.0}, {3: 1.0}))
    assert not is_stop_row(step(audio_mode, {ENDOFTEXT_ID: 1.0}, {3: 1.0}))


# ---- seeded reproducibility -------------------------------------------------------------------------------

RANDOM_TEXT_VOCAB = 64
NUM_STEPS = 8


def _random_logits(num_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed per-(request, step) logits: text [R, T, Vt] and audio [R, T, Va]."""
    gen = torch.Generator().manual_seed(1234)
    text = torch.randn(num_requests, NUM_STEPS, RANDOM_TEXT_VOCAB, generator=gen) * 2  # [R, T, Vt]
    audio = torch.randn(num_requests, NUM_STEPS, AUDIO_VOCAB, generator=gen) * 2  # [R, T, Va]
    audio[:, :, :64] += 6.0  # concentrate mass so draws repeat ids and the penalty matters
    return text, audio


def _make_samplers(num_requests: int) -> list[RequestSampler]:
    text = SamplingParams(temperature=0.9, top_p=0.9, top_k=30, repetition_penalty=1.2)
    audio = SamplingParams()  # upstream defaults
    return [
        RequestSampler([(3, AUDIO_PAD_ID), (7, 40)], text, audio, min_new_tokens=3, seed=100 + i)
        for i in range(num_requests)
    ]


def test_request_samples_do_not_depend_on_batch_composition() -> None:
    num_requests = 5
    text, audio = _random_logits(num_requests)
    alone = []
    for i, s in enumerate(_make_samplers(num_requests)):
        alone.append([sample_next_rows(text[i, t : t + 1], audio[i, t : t + 1], [s])[0] for t in range(NUM_STEPS)])

    batched = _make_samplers(num_requests)
    rows: list[list[tuple[int, int]]] = [[] for _ in range(num_requests)]
    order = random.Random(7)
    for t in range(NUM_STEPS):
        ids = list(range(num_requests))
        order.shuffle(ids)
        # Split the step into two batches of shuffled members to vary composition as well as order.
        for part in (ids[:2], ids[2:]):
            out = sample_next_rows(text[part, t], audio[part, t], [batched[i] for i in part])
            for i, row in zip(part, out, strict=True):
                rows[i].append(row)
    assert rows == alone
    assert len({tuple(r) for r in alone}) == num_requests  # distinct seeds give distinct streams


def test_same_seed_same_rows_and_greedy_text_keeps_audio_stream() -> None:
    text, audio = _random_logits(1)
    sampled_text = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    greedy_text = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    runs = []
    for text_params in (sampled_text, sampled_text, greedy_text):
        s = RequestSampler([(3, AUDIO_PAD_ID)], text_params, SamplingParams(), min_new_tokens=0, seed=5)
        runs.append([sample_next_rows(text[0, t : t + 1], audio[0, t : t + 1], [s])[0] for t in range(NUM_STEPS)])
    assert runs[0] == runs[1]
    # The text channel's uniform is drawn even when greedy, so the audio channel sees the same uniforms.
    assert [r[1] for r in runs[2]] == [r[1] for r in runs[0]]
    assert [r[0] for r in runs[2]] == text[0].argmax(dim=-1).tolist()


def test_inputs_are_not_modified() -> None:
    text, audio = _random_logits(1)
    text_in, audio_in = text[0, :1].clone(), audio[0, :1].clone()
    sample_next_rows(text_in, audio_in, _make_samplers(1))
    assert torch.equal(text_in, text[0, :1]) and torch.equal(audio_in, audio[0, :1])


def test_bfloat16_logits_sample_as_their_float32_widening() -> None:
    """A fast-path step of several rows returns its logits in bfloat16 (runtime/fast_forward.py): the sampler
    widens them itself, so the rows (and the inputs left untouched) are those of the widened logits."""
    num_requests = 3
    text, audio = (x.bfloat16() for x in _random_logits(num_requests))
    widened, low = _make_samplers(num_requests), _make_samplers(num_requests)
    for t in range(NUM_STEPS):
        want = sample_next_rows(text[:, t].float(), audio[:, t].float(), widened)
        text_in, audio_in = text[:, t].clone(), audio[:, t].clone()
        assert sample_next_rows(text_in, audio_in, low) == want
        assert torch.equal(text_in, text[:, t]) and torch.equal(audio_in, audio[:, t])


# ---- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": math.nan}, "temperature must be finite"),
        ({"temperature": math.inf}, "temperature must be finite"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 100\]"),
        ({"temperature": 1e39}, r"temperature must be in \[0, 100\]"),  # inf in float32: masked ids drawn
        ({"temperature": 100.5}, r"temperature must be in \[0, 100\]"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_p": math.nan}, "top_p must be finite"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer, got True"),  # would be top-k 1: greedy
        ({"temperature": True}, "temperature must be a number, got True"),
        ({"top_p": False}, "top_p must be a number, got False"),
        ({"repetition_penalty": True}, "repetition_penalty must be a number, got True"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": -1.1}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e-40}, r"repetition_penalty must be in \[0.01, 100\]"),  # overflowed logits
        ({"repetition_penalty": 1e39}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be finite"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()
    with pytest.raises(ValueError, match=message):
        RequestSampler([], SamplingParams(), SamplingParams(**kwargs), min_new_tokens=0, seed=0)


def test_sampling_params_boundaries_are_valid() -> None:
    assert SamplingParams() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    for params in (SamplingParams(), GREEDY, SamplingParams(temperature=0.0, top_p=1.0, top_k=0)):
        params.validate()


@pytest.mark.parametrize(
    ("prompt", "min_new_tokens", "seed", "message"),
    [
        ([], -1, 0, "min_new_tokens must be an integer >= 0"),
        ([], 0, -1, r"seed must be an integer in \[0, 2\*\*64\)"),
        ([], 0, 2**64, r"seed must be an integer in \[0, 2\*\*64\)"),
        ([(1, 2, 3)], 0, 0, r"a prompt row must be a \(text, audio\) pair"),
        ([(1, -2)], 0, 0, "row tokens must be non-negative integers"),
        ([(1, "a")], 0, 0, "row tokens must be integers"),
    ],
)
def test_request_sampler_validation(prompt: list, min_new_tokens: int, seed: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestSampler(prompt, SamplingParams(), SamplingParams(), min_new_tokens=min_new_tokens, seed=seed)


def test_sample_next_rows_rejects_bad_shapes() -> None:
    s = sampler()
    with pytest.raises(ValueError, match="got 1 samplers but text logits for 2 rows"):
        sample_next_rows(torch.zeros(2, 8), torch.zeros(2, AUDIO_VOCAB), [s])
    with pytest.raises(ValueError, match="audio logits need more than 16384 columns"):
        sample_next_rows(torch.zeros(1, 8), torch.zeros(1, EOSP_ID), [s])
    with pytest.raises(ValueError, match="logits must be 2-D"):
        sample_next_rows(torch.zeros(8), torch.zeros(1, AUDIO_VOCAB), [s])
    assert sample_next_rows(torch.zeros(0, 8), torch.zeros(0, AUDIO_VOCAB), []) == []


def test_history_id_outside_vocab_is_rejected() -> None:
    s = sampler([(20, 1)], text=greedy_with_penalty(1.1))
    with pytest.raises(ValueError, match=r"text history holds ids outside \[0, 16\): \[20\]"):
        sample_next_rows(torch.zeros(1, SMALL_TEXT_VOCAB), torch.zeros(1, AUDIO_VOCAB), [s])


# ---- the vectorised paths ------------------------------------------------------------------------------


def test_splitmix64_reference_values() -> None:
    # The first two outputs of SplitMix64 seeded with 0 (the generator's published test vector).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


@pytest.mark.parametrize("margin", [0, sampling.TOPK_TIE_MARGIN])
@pytest.mark.parametrize("ties_past_k", [False, True])
def test_topk_path_picks_the_same_ids_as_the_full_sort(
    monkeypatch: pytest.MonkeyPatch, ties_past_k: bool, margin: int
) -> None:
    monkeypatch.setattr(sampling, "TOPK_TIE_MARGIN", margin)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(48, 3000, generator=gen) * 3  # [S, V]
    logits[:, 7:10] = logits.max(dim=1, keepdim=True).values + 1  # a three-way tie at the top of every row
    if ties_past_k:  # a fourth id tied with the 3rd value: top_k=3 keeps all four (the full sort's job)
        logits[:24, 100] = logits[:24, 7]
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=1.0, top_k=3), greedy_with_penalty(1.0)] * 12
    uniforms = torch.rand(48, generator=gen)
    fast = sample_tokens(logits, params, uniforms)
    monkeypatch.setattr(sampling, "TOPK_FAST_MAX", 0)  # every batch takes the full sort
    full = sample_tokens(logits, params, uniforms)
    assert fast.tolist() == full.tolist()
    assert set(fast[3::4].tolist()) == {7}  # greedy rows: lowest id of the tie
    top3 = fast[2::4].tolist()
    assert set(top3) <= ({7, 8, 9, 100} if ties_past_k else {7, 8, 9})
    assert (100 in top3[:6]) is ties_past_k  # rows 2..22 (every 4th) have the fourth tied id


def test_ties_past_k_are_flagged_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # `_sample_tokens` never reads the GPU: it returns the rows whose ties with the k-th value reach past the
    # topk candidates, for the caller to check with the ids it reads anyway.
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 3.0, 3.0]])
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=3)] * 2 + [greedy_with_penalty(1.0)]
    _, ties = sampling._sample_tokens(logits, params, torch.tensor([0.5, 0.5, 0.5]))
    assert ties is not None and ties.tolist() == [False, False, False]  # the margin's candidates hold the tie
    monkeypatch.setattr(sampling, "TOPK_TIE_MARGIN", 0)  # exactly top_k candidates: the tie reaches past them
    _, ties = sampling._sample_tokens(logits, params, torch.tensor([0.5, 0.5, 0.5]))
    assert ties is not None and ties.tolist() == [True, False, False]  # greedy rows never need the sort
    _, ties = sampling._sample_tokens(logits, params, torch.tensor([0.5, 0.5, 0.5]), full_sort=True)
    assert ties is None


@pytest.mark.parametrize("margin, redraws", [(0, 6), (sampling.TOPK_TIE_MARGIN, 0)])
def test_sample_next_rows_redraws_a_channel_with_ties_past_k(
    monkeypatch: pytest.MonkeyPatch, margin: int, redraws: int
) -> None:
    # Audio logits with four ids tied at the top and top_k=3: HF keeps all four. Without a margin only the full
    # sort sees the fourth (one redraw per step); with the default margin the candidates hold it (no redraw).
    # Either way the step's rows must equal those of a sampler that always sorts fully.
    monkeypatch.setattr(sampling, "TOPK_TIE_MARGIN", margin)
    audio = torch.full((3, AUDIO_VOCAB), -5.0)
    audio[:, [11, 12, 13, 14]] = 4.0
    audio[1, 14] = 3.0  # row 1: no tie past k
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=3, repetition_penalty=1.0)

    def samplers() -> list[RequestSampler]:
        return [RequestSampler(AUDIO_PROMPT, SamplingParams(), params, min_new_tokens=0, seed=seed)
                for seed in (3, 4, 5)]

    before = sampling.num_full_sort_redraws
    fast = [sample_next_rows(None, audio, batch) for batch in [samplers()] for _ in range(6)]
    assert sampling.num_full_sort_redraws - before == redraws
    monkeypatch.setattr(sampling, "TOPK_FAST_MAX", 0)
    full = [sample_next_rows(None, audio, batch) for batch in [samplers()] for _ in range(6)]
    assert fast == full
    codes = {row[0][1] for row in fast} | {row[2][1] for row in fast}
    assert 14 in codes and codes <= {11, 12, 13, 14}  # the fourth tied id is drawn in the tied rows
    assert {row[1][1] for row in fast} <= {11, 12, 13}


def test_audio_mode_rows_ignore_text_logits_in_mixed_batches() -> None:
    text, audio = _random_logits(2)
    text_params = SamplingParams(temperature=0.9, top_p=0.9, top_k=30, repetition_penalty=1.2)

    def pair() -> list[RequestSampler]:
        return [RequestSampler(AUDIO_PROMPT, text_params, SamplingParams(), min_new_tokens=NUM_STEPS, seed=1),
                RequestSampler(TEXT_PROMPT, text_params, SamplingParams(), min_new_tokens=0, seed=2)]

    alone = [[sample_next_rows(text[i, t : t + 1], audio[i, t : t + 1], [s])[0] for t in range(NUM_STEPS)]
             for i, s in enumerate(pair())]
    batched = pair()
    garbage = text.clone()
    garbage[0] = math.nan  # the audio-mode request's text logits are never read
    rows = [sample_next_rows(garbage[:, t], audio[:, t], batched) for t in range(NUM_STEPS)]
    assert [[r[i] for r in rows] for i in range(2)] == alone
    assert {r[0] for r in alone[0]} == {MODALITY_PAD_ID}
    assert batched[0].mode == "audio" and batched[1].mode == "text"


def test_text_logits_may_be_skipped_only_when_no_row_samples_text() -> None:
    text, audio = _random_logits(2)
    audio_only = [RequestSampler(AUDIO_PROMPT, SamplingParams(), SamplingParams(), min_new_tokens=0, seed=s)
                  for s in (3, 4)]
    with_text = [RequestSampler(AUDIO_PROMPT, SamplingParams(), SamplingParams(), min_new_tokens=0, seed=s)
                 for s in (3, 4)]
    for t in range(NUM_STEPS):
        assert sample_next_rows(None, audio[:, t], audio_only) == sample_next_rows(text[:, t], audio[:, t], with_text)
    mixed = [audio_only[0], RequestSampler(TEXT_PROMPT, SamplingParams(), SamplingParams(), min_new_tokens=0, seed=5)]
    before = [s.num_generated for s in mixed]
    with pytest.raises(ValueError, match="1 request\\(s\\) sample in text mode but no text logits"):
        sample_next_rows(None, audio[:, 0], mixed)
    assert [s.num_generated for s in mixed] == before  # nothing appended


def test_ties_beyond_the_margin_still_take_the_full_sort() -> None:
    # 200 ids tied at the top with top_k=20: more ties than the 20 + margin candidates, so the row is flagged
    # and `sample_tokens` redraws it over the full sort, which may pick any of the 200.
    logits = torch.zeros(1, AUDIO_VOCAB)
    logits[0, 1000:1200] = 7.0
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=20)]
    assert 200 > 20 + sampling.TOPK_TIE_MARGIN
    _, ties = sampling._sample_tokens(logits, params, torch.tensor([0.99]))
    assert ties is not None and ties.tolist() == [True]
    assert sample_tokens(logits, params, torch.tensor([0.99])).item() == 1000 + int(0.99 * 200)


@pytest.mark.parametrize("params", [PLAIN, SamplingParams(top_k=20, top_p=0.8), GREEDY], ids=["plain", "topk", "greedy"])
def test_rows_whose_logits_have_no_valid_draw_are_flagged_not_sampled(params: SamplingParams) -> None:
    # Audio-mode rows 0-3 and a text-mode row 4. Row 1's audio has a NaN, row 2's audio is -inf everywhere
    # (nothing to draw), row 3's audio has +inf; row 4's text has a NaN (its audio is fine); row 0's text has a
    # NaN, which an audio-mode row never reads. The clamped draw never indexes out of bounds (on a GPU that
    # is an assert that ends the process); the flagged rows get None and their samplers do not move.
    prompts = [AUDIO_PROMPT] * 4 + [TEXT_PROMPT]
    samplers = [sampler(p, text=params, audio=params, seed=i) for i, p in enumerate(prompts)]
    twins = [sampler(p, text=params, audio=params, seed=i) for i, p in enumerate(prompts)]
    text = torch.randn(5, SMALL_TEXT_VOCAB, generator=torch.Generator().manual_seed(0))
    audio = torch.randn(5, AUDIO_VOCAB, generator=torch.Generator().manual_seed(1))
    text[0, 3] = text[4, 5] = math.nan
    audio[1, 11] = math.nan
    audio[2] = -math.inf
    audio[3, 12] = math.inf
    rows, changed = sampling.launch_next_rows(text, audio, samplers).complete()
    assert rows[1:4] == [None, None, None] and rows[4] is None and not changed
    assert [s.num_generated for s in samplers] == [1, 0, 0, 0, 0]
    alone = sample_next_rows(text[:1].nan_to_num(0.0), audio[:1], twins[:1])  # row 0 as if alone and clean
    assert rows[0] == alone[0] and rows[0][0] == MODALITY_PAD_ID
    with pytest.raises(sampling.NonFiniteLogitsError, match=r"row\(s\) \[1\]"):
        sample_next_rows(text[:2], audio[:2], twins[1:3])
