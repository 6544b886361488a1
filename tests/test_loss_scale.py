"""fp16-mixed's dynamic loss scaler against Megatron's DynamicGradScaler rule, step by step
(sequences worked by hand from Megatron-LM's megatron/core/optimizer/grad_scaler.py):
on overflow the growth window restarts and the hysteresis counter drops; at 0 (and below)
every overflow backs off; a full window of clean steps grows the scale and re-arms the
counter. An overflow at the minimum scale stops the run."""

import pytest

from framework.config import LossScaleConfig
from framework.train.loss_scale import LossScaleError, LossScaler


def _scales(flags, **cfg):
    s = LossScaler(LossScaleConfig(**cfg))
    out = []
    for k, overflow in enumerate(flags, 1):
        s.update(overflow, k)
        out.append(s.scale)
    return out


def test_hysteresis_delays_the_back_off_and_is_not_rearmed_by_clean_steps():
    # hysteresis 2: the 1st overflow is tolerated, the 2nd backs off (a clean step between
    # them does not re-arm the counter), and every further overflow backs off at once.
    assert _scales([True, False, True, True, False], initial=1024, hysteresis=2, growth_interval=10) == \
        [1024, 1024, 512, 256, 256]
    assert _scales([True, True], initial=1024, hysteresis=1, growth_interval=10) == [512, 256]


def test_growth_after_a_clean_window_rearms_hysteresis():
    # window 3: grows after 3 clean steps; an overflow restarts the window.
    flags = [False, False, True, False, False, False, True, True]
    # step 3: overflow #1 (tolerated, counter 2 -> 1, window restarts); steps 4-6 clean: x2 at
    # step 6, counter back to 2; step 7: overflow tolerated (2 -> 1); step 8: back-off.
    assert _scales(flags, initial=8, hysteresis=2, growth_interval=3) == [8, 8, 8, 8, 8, 16, 16, 8]


def test_back_off_stops_at_the_minimum_and_an_overflow_there_is_an_error():
    s = LossScaler(LossScaleConfig(initial=4, hysteresis=1, min_scale=1, growth_interval=100))
    s.update(True, 1)
    s.update(True, 2)
    assert s.scale == 1
    with pytest.raises(LossScaleError, match=r"step 3: .*minimum loss scale precision.loss_scale.min_scale=1"):
        s.update(True, 3)


def test_state_round_trips():
    a = LossScaler(LossScaleConfig(initial=64, hysteresis=3, growth_interval=5))
    for k, f in enumerate([False, True, False], 1):
        a.update(f, k)
    b = LossScaler(LossScaleConfig(initial=64, hysteresis=3, growth_interval=5))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 64.0, "growth_tracker": 1, "hysteresis_tracker": 2}
